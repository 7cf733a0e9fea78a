"""One reader for the text, JSON and JSON-lines files a user hands to a command.

Every command reads its input files (prompts, held-out sets, configs, reports, recipes, caches) through here, so
a missing file, a folder, a binary or non-UTF-8 file, one far larger than such a file can be, JSON nested deeper
than any real one, a number JSON cannot hold, or a corrupt `.gz` is one ToolkitError line naming the file (and
the byte where decoding failed), never a traceback. A name ending in `.gz` is decompressed first.

Every number read from such a file passes one validator, `Num` (`number`, `numbers`, `number_table`): a type, a
finite range and a unit; a value outside is one line naming the file, the key and the range. Integers are
compared as integers, so one of 401 digits is refused, never overflowed.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolkitError

MAX_BYTES = 64 * 2**20          # a prompt set, a held-out set, a report or a config is far smaller
MAX_DEPTH = 64                  # nesting levels of any JSON the toolkit reads (real ones have fewer than 10)


def _pre(what: str) -> str:
    return f"{what}: " if what and not what.endswith(": ") else what


def read_bytes(path: str | Path, what: str = "", limit: int = MAX_BYTES) -> bytes:
    """The file's bytes (decompressed when its name ends in .gz), at most `limit` of them."""
    p, pre = Path(path).expanduser(), _pre(what)
    if not p.exists():
        raise ToolkitError(f"{pre}{p}: no such file")
    if p.is_dir():
        raise ToolkitError(f"{pre}{p} is a folder, not a file")
    if not p.is_file():
        raise ToolkitError(f"{pre}{p} is not a regular file")
    if p.stat().st_size > limit:
        raise ToolkitError(f"{pre}{p} is {p.stat().st_size / 2**20:.1f} MiB, larger than the {limit / 2**20:.0f} MiB "
                           "such a file can be")
    try:
        if p.name.endswith(".gz"):
            with gzip.open(p, "rb") as f:
                data = f.read(limit + 1)
            if len(data) > limit:
                raise ToolkitError(f"{pre}{p} decompresses to more than {limit / 2**20:.0f} MiB")
            return data
        return p.read_bytes()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ToolkitError(f"{pre}{p} is not a readable gzip file ({e or type(e).__name__})") from None
    except OSError as e:
        raise ToolkitError(f"{pre}cannot read {p} ({e.strerror or e})") from None


def read_head(path: str | Path, what: str = "", n: int = 1 << 16) -> str:
    """The first `n` bytes of a file too large to read whole, as UTF-8 text (a character cut at the end is fine)."""
    p, pre = Path(path).expanduser(), _pre(what)
    read_bytes(p, what, limit=0) if not p.is_file() else None
    try:
        with open(p, "rb") as f:
            head = f.read(n)
    except OSError as e:
        raise ToolkitError(f"{pre}cannot read {p} ({e.strerror or e})") from None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < n)
    except UnicodeDecodeError as e:
        raise ToolkitError(f"{pre}{p} is not UTF-8 text (byte {e.start}: {head[e.start:e.start + 1]!r})") from None
    if "\x00" in text:
        raise ToolkitError(f"{pre}{p} is not a text file (a NUL byte at byte {head.index(0)})")
    return text


def decode(data: bytes, where: str) -> str:
    """UTF-8 text (a leading BOM dropped); a byte that is not UTF-8, or a NUL byte, is one line naming its offset."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ToolkitError(f"{where} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if "\x00" in text:
        raise ToolkitError(f"{where} is not a text file (a NUL byte at byte {data.index(0)})")
    return text


def read_text(path: str | Path, what: str = "", limit: int = MAX_BYTES) -> str:
    """The file as UTF-8 text."""
    return decode(read_bytes(path, what, limit), f"{_pre(what)}{Path(path).expanduser()}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def depth(obj) -> int:
    """Nesting levels of a parsed JSON value (iterative: any depth is safe to measure)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def parse_json(text: str, where: str):
    """A JSON value from text; invalid JSON, NaN/Infinity, an overlong number or deep nesting is one line."""
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ToolkitError(f"{where} is nested deeper than {MAX_DEPTH} levels; not a file of this kind") from None
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:          # NaN / Infinity, or an integer of more than 4300 digits
        raise ToolkitError(f"{where} is not valid JSON ({e})") from None
    if depth(obj) > MAX_DEPTH:
        raise ToolkitError(f"{where} is nested deeper than {MAX_DEPTH} levels; not a file of this kind")
    return obj


def read_json(path: str | Path, what: str = "", limit: int = MAX_BYTES):
    """A JSON file's value (see parse_json)."""
    where = f"{_pre(what)}{Path(path).expanduser()}"
    return parse_json(decode(read_bytes(path, what, limit), where), where)


def read_object(path: str | Path, what: str = "", limit: int = MAX_BYTES) -> dict:
    """A JSON file that must hold an object."""
    obj = read_json(path, what, limit)
    if not isinstance(obj, dict):
        raise ToolkitError(f"{_pre(what)}{Path(path).expanduser()}: expected a JSON object, got a JSON {type(obj).__name__}")
    return obj


def read_jsonl(path: str | Path, what: str = "", limit: int = MAX_BYTES) -> list[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSON-lines file."""
    where = f"{_pre(what)}{Path(path).expanduser()}"
    lines = read_text(path, what, limit).splitlines()
    return [(n, parse_json(line, f"{where} line {n}")) for n, line in enumerate(lines, 1) if line.strip()]


def package_file(module: str, rel: str, package: str, hint: str = "") -> Path:
    """A data file inside an installed package, found without importing it; one line when either is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ToolkitError(f"the {package} package is not installed: pip install {package}{hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise ToolkitError(f"{path}: missing from the {package} package")
    return path


def shown(value, width: int = 40) -> str:
    """A value as an error line quotes it: its repr, or for a long one what it is (a 401-digit integer)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**width:
        return f"a {len(str(abs(value)))}-digit integer"
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 3]}..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_numbers(obj, where: str, lo: float = -1e15, hi: float = 1e15) -> None:
    """Every number in a parsed JSON value lies in [lo, hi] (a cache entry of 1e300 or a 401-digit integer is
    refused, never overflowed: ints are compared as ints)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if _is_number(o):
            if not (isinstance(o, int) or math.isfinite(o)) or not lo <= o <= hi:
                raise ToolkitError(f"{where} holds the number {shown(o)}, outside [{lo:g}, {hi:g}]")
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


@dataclass(frozen=True)
class Num:
    """What a number read from a file may be: a whole number or any number, in a finite range (`lo` excluded
    when `above`), in a unit; `null` allows JSON null (a value that was not measured)."""

    lo: float
    hi: float
    unit: str = ""
    whole: bool = False
    null: bool = False
    above: bool = False

    def words(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        lo, hi = (f"{x:g}" if isinstance(x, float) else str(x) for x in (self.lo, self.hi))
        span = f"> {lo} and at most {hi}" if self.above else f"from {lo} to {hi}"
        return f"{kind} {span}{' ' + self.unit if self.unit else ''}{' (or null)' if self.null else ''}"

    def ok(self, value) -> bool:
        if value is None:
            return self.null
        if not _is_number(value) or (self.whole and not isinstance(value, int)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (self.lo < value if self.above else self.lo <= value) and value <= self.hi   # int vs float: exact


def number(value, num: Num, where: str, key: str):
    """`value` when it is what `num` allows; else one line naming the file (`where`), the key and the range."""
    if not num.ok(value):
        raise ToolkitError(f"{where}: {key} must be {num.words()}, got {shown(value)}")
    return value


def numbers(d: dict, spec: dict[str, Num], where: str, prefix: str = "") -> dict:
    """Each key of `spec` present in the mapping `d` checked by `number` (`prefix` leads the key's name)."""
    for key, num in spec.items():
        if key in d:
            number(d[key], num, where, f"{prefix}{key}")
    return d


def number_key(text, num: Num, where: str, key: str) -> int:
    """A whole number written as a JSON object key ("16"), in `num`'s range; else one line."""
    ok = isinstance(text, str) and len(text) <= 20 and re.fullmatch(r"-?\d+", text)
    return number(int(text) if ok else text, num, where, key)


def number_table(obj, keys: tuple[Num, ...], value: Num, where: str, name: str = "") -> dict:
    """A table of numbers keyed by whole numbers, as JSON writes it ({"1": {"0": 1.5}} for two keys): every key
    and value checked, returned with int keys. Anything else is one line naming the entry."""
    if not isinstance(obj, dict) or not obj:
        raise ToolkitError(f"{where}: {name or 'the table'} must be a non-empty JSON object, got {shown(obj)}")
    out = {}
    for k, v in obj.items():
        at = f"{name}[{shown(k)}]" if name else f"[{shown(k)}]"
        k = number_key(k, keys[0], where, f"the key of {at}")
        out[k] = number_table(v, keys[1:], value, where, at) if len(keys) > 1 else number(v, value, where, at)
    return out
