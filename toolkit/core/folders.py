"""Files and model folders: JSON and config.json reading with one-line errors, file hashes, atomic writes.

The output policy of every command lives here (docs/outputs.md): `claim` checks an output location before any
work starts and refuses a non-empty folder that is not the command's own earlier output unless forced;
`atomic_dir` / `atomic_file` write beside the final path and replace it only once the new output is complete,
so nothing half-written is left and nothing the command did not write is deleted without --force. A full disk
is one line naming the path and the bytes needed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import OptionError, ToolkitError

MARKER = ".dflash-toolkit.json"   # {"command": ...} in every folder a command writes: its own earlier output


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


def owner(folder: str | Path) -> str | None:
    """The command that wrote `folder` (its marker), or None for a folder no command of ours wrote."""
    try:
        return json.loads((Path(folder) / MARKER).read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        return None


def mark(folder: str | Path, command: str) -> None:
    """Record in `folder` that `command` wrote it, so a rerun may replace it without --force."""
    (Path(folder) / MARKER).write_text(json.dumps({"command": command}) + "\n")


def claim(out: str | Path, command: str, force: bool, field: str = "out", force_flag: str = "--force",
          own: bool = True) -> Path:
    """Check an output folder before any work: refuse a file, a path under a file, an unwritable place, the current
    folder or one above it, and a non-empty folder that is not `command`'s earlier output unless forced."""
    out = Path(out).expanduser()
    full, cwd = out.resolve(), Path.cwd().resolve()
    if full == cwd or full in cwd.parents or full == Path.home().resolve():
        raise OptionError(field, f"{out} is the current folder, one above it or the home folder: name a new folder for the output")
    if out.exists() and not out.is_dir():
        raise OptionError(field, f"{out} exists and is not a folder")
    check_place(out, field)
    if out.is_dir() and any(out.iterdir()) and not force and not (own and owner(out) == command):
        raise OptionError(field, f"{out} exists and is not empty, and is not an earlier output of {command} "
                                 f"(pass {force_flag} to replace it once the new output is complete)")
    return out


def check_place(out: Path, field: str = "out") -> None:
    """Refuse a path under a file or in a place that cannot be written: one OptionError naming `field`."""
    full = out.expanduser().resolve()
    up = full.parent
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise OptionError(field, f"{out} is under {up}, which is a file")
    place = full if full.exists() else up
    if not os.access(place, os.W_OK):
        raise OptionError(field, f"cannot write in {place} (permission denied)")


def claim_file(out: str | Path, field: str = "out") -> Path:
    """Check an output *file* before any work: refuse a folder, a path under a file, an unwritable place."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise OptionError(field, f"{out} is a folder: name a JSON file")
    check_place(out, field)
    return out


def no_space(path: Path, need: int | None = None) -> ToolkitError:
    """The one-line error for a full disk while writing `path`."""
    free = shutil.disk_usage(next(p for p in [path, *path.parents] if p.exists())).free
    want = f"about {need / 2**20:.1f} MiB needed, " if need else ""
    return ToolkitError(f"no space left on the device writing {path}: {want}{free / 2**20:.1f} MiB free")


def check_space(path: str | Path, need: int) -> None:
    """Refuse before writing when the disk holding `path` plainly has less than `need` bytes free."""
    path = Path(path)
    if shutil.disk_usage(next(p for p in [path, *path.parents] if p.exists())).free < need:
        raise no_space(path, need)


def atomic_file(path: str | Path, data: str | bytes) -> Path:
    """Write a file beside `path` and rename it into place: readers never see half of it, a full disk leaves nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise no_space(path, len(data)) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def atomic_dir(out: str | Path, command: str | None = None, need: int | None = None) -> Iterator[Path]:
    """A temp folder beside `out` that replaces `out` only if the block finishes; otherwise it is removed.

    The old `out`, if any, is moved aside before the new one takes its place, so a reader never sees a half-written
    folder; the result is 0755 (mkdtemp's 0700 would hide a shared cache from other users). With `command` the
    result is marked as that command's output; a full disk is one ToolkitError naming `out` (and `need` bytes)."""
    out = Path(out)
    if need:
        check_space(out.parent if out.parent.exists() else Path.cwd(), need)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if command:
            mark(tmp, command)
        os.chmod(tmp, 0o755)
        if out.is_dir():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise no_space(out, need) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
