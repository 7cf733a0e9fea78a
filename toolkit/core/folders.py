"""Files and model folders: JSON and config.json reading with one-line errors, file hashes, atomic folder writes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import ToolkitError


def read_json(path: str | Path, prefix: str = "", missing: str = "no such file"):
    """A JSON file's content; a missing or broken file is one ToolkitError line starting with `prefix`."""
    p = Path(path)
    if not p.is_file():
        raise ToolkitError(f"{prefix}{p}: {missing}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{prefix}{p} is not valid JSON ({e.msg} at line {e.lineno})") from None


def read_config(folder: str | Path, what: str | None = None) -> dict:
    """config.json of a model folder as a dict; `what` names the flag in errors (e.g. "model" -> "--model: ...")."""
    prefix = f"--{what}: " if what else ""
    if not (Path(folder) / "config.json").is_file():
        raise ToolkitError(f"{prefix}{folder} has no config.json (not a model folder)")
    return read_json(Path(folder) / "config.json", prefix)


def sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_out(out: str | Path, prefix: str, force: bool, force_flag: str) -> None:
    """Refuse an output path that is a file, or a non-empty folder unless forced: one line starting with `prefix`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"{prefix}{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ToolkitError(f"{prefix}{out} exists and is not empty (pass {force_flag} to replace it)")


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """A temp folder beside `out` that replaces `out` only if the block finishes; otherwise it is removed.

    The old `out`, if any, is moved aside before the new one takes its place, so a reader never sees a half-written
    folder; the result is 0755 (mkdtemp's 0700 would hide a shared cache from other users)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if out.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
