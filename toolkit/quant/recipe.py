"""Recipes: one TOML file per upstream drafter (model, pinned revision, target, bitrates, overrides, prompts, thresholds)."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..core import files
from ..core.files import Num, number, numbers, shown
from ..core.errors import ToolkitError
from .source import split_ref

# exllamav3 1.6.5 takes a budget of 1-8 bpw; the half-integer rates (1.5/2.5/3.5) exist with its mul1 codebook.
MIN_BITS, MAX_BITS = 1.0, 8.0
HALF_RATES = (1.5, 2.5, 3.5)


@dataclass
class Thresholds:
    """Per-bitrate quality floor; a metric that was not measured is not judged."""

    min_top1: float | None = None
    max_kl: float | None = None
    min_tau_ratio: float | None = None   # tau(EXL3) / tau(BF16)


@dataclass
class Recipe:
    model: str
    target: str | None = None
    revision: str | None = None
    target_revision: str | None = None
    bits: list[float] = field(default_factory=lambda: [4.0])
    overrides: dict[str, float] = field(default_factory=dict)   # tensor key pattern -> bits (exllamav3 --recipe)
    calibration_prompts: list[str] = field(default_factory=list)
    check_prompts: list[str] = field(default_factory=list)
    anchors_per_prompt: int = 8
    max_new_tokens: int = 64
    tap_shift_candidates: list[int] = field(default_factory=lambda: [0, 1])
    draft_tokens: list[int] = field(default_factory=list)   # widths the exllamav3 check sweeps ([]: 3, 7, B-1)
    thresholds: dict[str, Thresholds] = field(default_factory=dict)   # "4.0" or "default" -> floor
    expect: dict = field(default_factory=dict)   # [model.expect]: drafter config values the fetched revision must have
    path: Path | None = None

    def check_expected(self, config) -> None:
        """Refuse a drafter whose config differs from what the recipe was written for (e.g. an older revision)."""
        for key, want in self.expect.items():
            have = getattr(config, key, None)
            if have != want:
                raise ToolkitError(f"--model: {key} is {have!r}, the recipe {self.path.name if self.path else ''} expects "
                                   f"{want!r} (another revision of {self.model}? pass --revision)")

    def thresholds_for(self, bits: float) -> Thresholds:
        return self.thresholds.get(format_bits(bits)) or self.thresholds.get("default") or Thresholds()


def format_bits(bits: float) -> str:
    """4 -> '4.0', 4.25 -> '4.25' (exllamav3's Hub branch style is '<bits>bpw')."""
    s = f"{bits:.2f}".rstrip("0")
    return s + "0" if s.endswith(".") else s


def branch_name(bits: float) -> str:
    return f"{format_bits(bits)}bpw"


def check_bits(value: float, field_name: str = "bits") -> float:
    """One bitrate: a finite number in 1..8 with at most two decimals (exllamav3 rounds its budget to 0.01)."""
    try:
        b = float(value)
    except (TypeError, ValueError):
        raise ToolkitError(f"{field_name}: {shown(value)} is not a number") from None
    except OverflowError:                   # an integer of hundreds of digits
        b = math.inf
    if not math.isfinite(b) or not MIN_BITS <= b <= MAX_BITS:
        raise ToolkitError(f"{field_name}: {shown(value)} is outside exllamav3's range 1-8 bits per weight")
    if abs(round(b, 2) - b) > 1e-9:
        raise ToolkitError(f"{field_name}: {value!r} is not representable (at most two decimals, e.g. 4.25)")
    return round(b, 2)


def parse_bits(spec: str | list | tuple | float) -> list[float]:
    """'3.0,4.0,5.0' or a list -> sorted unique bitrates, each checked."""
    items = spec.split(",") if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else [spec]
    items = [i.strip() if isinstance(i, str) else i for i in items]
    if not items or any(i == "" for i in items):
        raise ToolkitError(f"bits: {spec!r} is empty or has an empty entry")
    out = [check_bits(i) for i in items]
    if len(set(out)) != len(out):
        raise ToolkitError(f"bits: {spec!r} lists a bitrate twice")
    return sorted(out)


def check_override_bits(pattern: str, value: float) -> float:
    """A per-tensor override must be a rate exllamav3 stores directly: integers 1-8, 16 (unquantized), or 1.5/2.5/3.5."""
    try:
        b = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ToolkitError(f"overrides.{pattern}: {shown(value)} is not a number of bits") from None
    if not ((b.is_integer() and (1 <= b <= 8 or b == 16)) or b in HALF_RATES):
        raise ToolkitError(f"overrides.{pattern}: {shown(value)} must be an integer 1-8, 16, or one of 1.5, 2.5, 3.5")
    return b


def _thresholds(raw: dict, where: Path) -> dict[str, Thresholds]:
    out = {}
    for key, val in raw.items():
        if not isinstance(val, dict):
            raise ToolkitError(f"{where}: thresholds.{key} must be a table like {{ min_top1 = 0.9 }}")
        unknown = set(val) - {"min_top1", "max_kl", "min_tau_ratio"}
        if unknown:
            raise ToolkitError(f"{where}: thresholds.{key} has unknown keys {sorted(unknown)}")
        name = key if key == "default" else format_bits(check_bits(key, f"thresholds.{key}"))
        numbers(val, THRESHOLDS, f"recipe: {where}", f"thresholds.{key}.")
        out[name] = Thresholds(**{k: float(v) for k, v in val.items()})
    return out


# The recipe's numbers: type, finite range and unit (core.files.Num); a value outside is one line naming it.
THRESHOLDS = {"min_top1": Num(0, 1, "(a share of positions)"), "max_kl": Num(0, 1e6, "nats"),
              "min_tau_ratio": Num(0, 100, "(tau of the quant over tau of BF16)")}
NUMBERS = {"calibration.anchors_per_prompt": Num(1, 4096, "anchors per prompt", whole=True),
           "check.max_new_tokens": Num(1, 65536, "tokens", whole=True)}
LISTS = {"check.tap_shift_candidates": Num(-64, 64, "layers", whole=True),
         "check.draft_tokens": Num(1, 1024, "drafts per round", whole=True)}


def _whole_list(raw, name: str, where: Path) -> list[int]:
    """A non-empty list of whole numbers in LISTS[name]'s range, each once (sorted); else one line naming it."""
    if not isinstance(raw, list) or not raw:
        raise ToolkitError(f"recipe: {where}: {name} must be a non-empty list of whole numbers, got {shown(raw)}")
    for i, v in enumerate(raw):
        number(v, LISTS[name], f"recipe: {where}", f"{name}[{i}]")
    return sorted(set(raw))


TYPE_WORDS = {str: "a string", int: "an integer", dict: "a table", list[str]: "a list of strings",
              list[int]: "a list of integers", (str, float, list): "a number, a string or a list of numbers"}


def _table(raw: dict, key: str, where: Path) -> dict:
    """A top-level table of the recipe ({} when absent); any other type is one line naming it."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ToolkitError(f"recipe: {where}: [{key}] must be a table, got {value!r}")
    return value


def _check_type(value, kind, name: str, where: Path) -> None:
    """A recipe field of the expected TOML type (None: absent, the default applies); else one line naming it."""
    if value is None:
        return
    if kind in (list[str], list[int]):
        elem = str if kind == list[str] else int
        ok = isinstance(value, list) and all(isinstance(v, elem) and not isinstance(v, bool) for v in value)
    elif kind == (str, float, list):
        ok = isinstance(value, (str, int, float, list)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and kind is int and value < 1 and name != "check.tap_shift_candidates":
        ok = False
    if not ok:
        raise ToolkitError(f"recipe: {where}: {name} must be {TYPE_WORDS[kind]}{' >= 1' if kind is int else ''}, got {value!r}")


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe TOML; every problem is one line naming the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise ToolkitError(f"recipe: {p} does not exist")
    try:
        raw = tomllib.loads(files.read_text(p, "recipe"))
    except tomllib.TOMLDecodeError as e:
        raise ToolkitError(f"recipe: {p} is not valid TOML ({e})") from None
    except RecursionError:
        raise ToolkitError(f"recipe: {p} is nested deeper than any recipe") from None
    model, target, cal, chk, bits = (_table(raw, k, p) for k in ("model", "target", "calibration", "check", "bits"))
    if not model.get("id"):
        raise ToolkitError(f"recipe: {p} has no [model] id")
    for where, table, key, kind in (("model", model, "id", str), ("model", model, "revision", str),
                                    ("target", target, "id", str), ("target", target, "revision", str),
                                    ("model", model, "expect", dict), ("calibration", cal, "prompts", list[str]),
                                    ("check", chk, "prompts", list[str]), ("calibration", cal, "anchors_per_prompt", int),
                                    ("check", chk, "max_new_tokens", int), ("check", chk, "tap_shift_candidates", list[int]),
                                    ("bits", bits, "default", (str, float, list))):
        _check_type(table.get(key), kind, f"{where}.{key}", p)
        if f"{where}.{key}" in NUMBERS and table.get(key) is not None:
            number(table[key], NUMBERS[f"{where}.{key}"], f"recipe: {p}", f"{where}.{key}")
    overrides = {k: check_override_bits(k, v) for k, v in _table(raw, "overrides", p).items()}
    return Recipe(
        model=model["id"],
        revision=model.get("revision"),
        target=target.get("id"),
        target_revision=target.get("revision"),
        bits=parse_bits(bits.get("default", [4.0])),
        overrides=overrides,
        calibration_prompts=list(cal.get("prompts", [])),
        check_prompts=list(chk.get("prompts", [])),
        anchors_per_prompt=int(cal.get("anchors_per_prompt", 8)),
        max_new_tokens=int(chk.get("max_new_tokens", 64)),
        tap_shift_candidates=_whole_list(chk.get("tap_shift_candidates", [0, 1]), "check.tap_shift_candidates", p),
        draft_tokens=_whole_list(chk["draft_tokens"], "check.draft_tokens", p) if chk.get("draft_tokens", []) != [] else [],
        thresholds=_thresholds(_table(raw, "thresholds", p), p),
        expect=dict(model.get("expect") or {}),
        path=p,
    )


@dataclass
class Settings:
    """The merged recipe + command line of one quantize run."""

    model: str
    model_id: str
    revision: str | None
    target: str | None
    target_revision: str | None
    bits: list[float]
    out: Path
    work_dir: Path | None     # None: OUT/.work, inside the folder this run writes
    recipe: Recipe = field(default_factory=lambda: Recipe(model=""))
    target_model: str | None = None   # the Hub model the drafter serves, as the cards name it (never a path)
    model_local: bool = False         # model_id is a folder of this machine, not a Hub id
    target_local: bool = False        # --target is a folder of this machine


def served_model(flag: str | None, recipe: Recipe | None) -> str | None:
    """--target-model (a Hub id USER/NAME), else the recipe's [target] id when it is one."""
    from ..core.refs import is_repo_id

    if flag is not None:
        if not (is_repo_id(flag) and flag.count("/") == 1):
            raise ToolkitError(f"--target-model must be the Hub id USER/NAME of the model the drafter serves, got {flag!r}")
        return flag
    name = recipe.target if recipe else None
    return name if name and is_repo_id(name) and name.count("/") == 1 and not Path(name).exists() else None


def merge(recipe: str | None, model: str | None, revision: str | None, target: str | None, bits, out: str | None,
          work_dir: str | None, target_model: str | None = None) -> Settings:
    """The run's settings: a flag wins over the recipe; the recipe's pinned revisions follow only its own model and target."""
    r = load_recipe(recipe) if recipe else None
    if not model and not r:
        raise ToolkitError("--model is required without --recipe")
    model = model or r.model
    from_recipe = r is not None and model == r.model
    repo, named = split_ref(model, "model")            # USER/NAME@REVISION names its revision itself
    model_id = r.model if r else repo
    rev = revision or named or (r.revision if r and (from_recipe or Path(model).is_dir()) else None)
    tgt = target or (r.target if r else None)
    trev = r.target_revision if r and tgt == r.target else None
    b = parse_bits(bits) if bits else (r.bits if r else [4.0])
    o = Path(out) if out else Path("out") / (model_id.rstrip("/").split("/")[-1] + "-exl3")
    return Settings(model, model_id, rev, tgt, trev, b, o, Path(work_dir) if work_dir else None, r or Recipe(model=model),
                    served_model(target_model, r), model_id == repo and not r and Path(model).expanduser().is_dir(),
                    bool(tgt) and Path(tgt).expanduser().is_dir())
