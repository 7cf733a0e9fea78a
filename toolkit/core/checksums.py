"""Cached folders that prove themselves: a folder is reused only when every file its record lists has the recorded
size and sha256.

A file is hashed once; its size, mtime and inode are then remembered beside it (SEEN), and a later check hashes it
again only when one of them changed, so a file overwritten in place (same size, other bytes) is always caught.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import ToolkitError
from .files import Num, number
from .folders import atomic_file, sha256

SEEN = ".checked.json"         # name -> [size, mtime_ns, inode, sha256] of the files last found to match
SIZE = Num(0, 2**50, "bytes", whole=True)
HEX = re.compile(r"[0-9a-f]{64}")


def check_record(record, where: str) -> dict[str, dict]:
    """{file name: {"size": bytes, "sha256": hex}} of plain file names (no folder, no dot file); else one line."""
    if not isinstance(record, dict) or not record:
        raise ToolkitError(f"{where}: files must be a non-empty object of file name -> size and sha256")
    for name, f in record.items():
        if Path(name).name != name or name.startswith(".") or not isinstance(f, dict):
            raise ToolkitError(f"{where}: files[{name[:40]!r}] is not a file of the folder with its size and sha256")
        number(f.get("size"), SIZE, where, f"files[{name!r}].size")
        if not isinstance(f.get("sha256"), str) or not HEX.fullmatch(f["sha256"]):
            raise ToolkitError(f"{where}: files[{name!r}].sha256 must be 64 hex digits")
    return record


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _seen(folder: Path) -> dict:
    try:
        d = json.loads((folder / SEEN).read_text(encoding="utf-8")) if (folder / SEEN).is_file() else {}
    except (OSError, ValueError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}


def proven(folder: str | Path, record, where: str = "") -> bool:
    """True when every file of `record` (see check_record) is a regular file of `folder`, not a link, with the
    recorded size and sha256. What could not be remembered (a read-only cache) only costs a hash next time."""
    folder = Path(folder)
    try:
        record = check_record(record, where or str(folder))
    except ToolkitError:
        return False
    seen, changed = _seen(folder), False
    for name, f in record.items():
        p = folder / name
        if p.is_symlink() or not p.is_file() or p.stat().st_size != f["size"]:
            return False
        stamp = _stamp(p) + [f["sha256"]]
        if seen.get(name) == stamp:
            continue
        if sha256(p) != f["sha256"]:
            return False
        seen[name], changed = stamp, True
    if changed:
        try:
            atomic_file(folder / SEEN, json.dumps(seen) + "\n")
        except (OSError, ToolkitError):
            pass
    return True
