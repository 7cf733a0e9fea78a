"""Files and model folders: JSON and config.json reading with one-line errors, file hashes, atomic writes.

The output policy of every command lives here (docs/outputs.md): `claim` / `claim_file` check an output location
before any work starts and refuse a symlink, and a non-empty folder (or an existing file) that is not the
command's own earlier output unless forced; own output is recognised by a marker the toolkit writes (`mark`,
`marker`), checked field by field. `atomic_dir` / `atomic_file` / `atomic_write` write beside the final path and
replace it only once the new output is complete, so nothing half-written is left and nothing the command did not
write is deleted without --force. Their temp names carry this host and process, and every one of them first
removes what a killed run of itself left beside the same path (`sweep`), so each command that writes through them
cleans up after a killed run. A full disk is one line naming the path and the bytes needed. Copying a folder
without following links is core.copying's, one run per output core.locks'."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .. import __version__
from . import files
from .errors import OptionError, ToolkitError, disk_full

MARKER = ".dflash-toolkit.json"   # the own-output marker in every folder a command writes (see `marker`)
TOOLKIT = "dflash-exl3-toolkit"
HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"
TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old|src)-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-")


def read_json(path: str | Path, prefix: str = "", missing: str = "no such file"):
    """A JSON file's content (core.files: UTF-8, size and depth caps); a missing or broken file is one
    ToolkitError line starting with `prefix`."""
    p = Path(path)
    if not p.exists():
        raise ToolkitError(f"{prefix}{p}: {missing}")
    return files.read_json(p, prefix)


def read_config(folder: str | Path, what: str | None = None) -> dict:
    """config.json of a model folder as a dict; `what` names the flag in errors (e.g. "model" -> "--model: ...")."""
    prefix = f"--{what}: " if what else ""
    if not (Path(folder) / "config.json").is_file():
        raise ToolkitError(f"{prefix}{folder} has no config.json (not a model folder)")
    cfg = read_json(Path(folder) / "config.json", prefix)
    if not isinstance(cfg, dict):
        raise ToolkitError(f"{prefix}{Path(folder) / 'config.json'} is not a JSON object (a JSON {type(cfg).__name__})")
    return cfg


def sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def marker(command: str) -> dict:
    """The own-output marker of `command`: which toolkit wrote it, the marker's format, the command, the version."""
    return {"toolkit": TOOLKIT, "marker": 1, "command": command, "version": __version__}


def marked_by(value) -> str | None:
    """The command of a marker dict, checked field by field (exactly the four fields, of their values and types);
    None for anything else, such as a user's file that happens to have a `command` key."""
    if not (isinstance(value, dict) and set(value) == {"toolkit", "marker", "command", "version"}):
        return None
    ok = (value["toolkit"] == TOOLKIT and value["marker"] == 1 and isinstance(value["command"], str)
          and isinstance(value["version"], str) and value["command"] and value["version"])
    return value["command"] if ok else None


def owner(folder: str | Path) -> str | None:
    """The command that wrote `folder` (its marker, a small regular file), or None for a folder no command wrote."""
    path = Path(folder) / MARKER
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 4096:
            return None
        return marked_by(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def mark(folder: str | Path, command: str) -> None:
    """Record in `folder` that `command` wrote it, so a rerun may replace it without --force."""
    atomic_file(Path(folder) / MARKER, json.dumps(marker(command)) + "\n")


def file_owner(path: str | Path) -> str | None:
    """The command that wrote a JSON file (its `written_by` field) or a PNG (its `dflash-toolkit` text chunk)."""
    p = Path(path)
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > files.MAX_BYTES:
            return None
        if p.suffix == ".png":
            return marked_by(json.loads(png_text(p.read_bytes()).get("dflash-toolkit", "null")))
        d = json.loads(p.read_text(encoding="utf-8"))
        return marked_by(d.get("written_by")) if isinstance(d, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def png_text(data: bytes) -> dict[str, str]:
    """The tEXt chunks of a PNG (matplotlib writes savefig's `metadata` there)."""
    out, k = {}, 8
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return out
    while k + 8 <= len(data):
        n, kind = int.from_bytes(data[k:k + 4], "big"), data[k + 4:k + 8]
        if kind == b"tEXt":
            key, _, value = data[k + 8:k + 8 + n].partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        k += 12 + n
    return out


def claim(out: str | Path, command: str, force: bool, field: str = "out", force_flag: str | None = "--force",
          own: bool = True) -> Path:
    """Check an output folder before any work: refuse a file, a symlink, a path under a file, an unwritable place,
    the current folder or one above it, and a non-empty folder that is not `command`'s earlier output (by its
    marker) unless forced (`force_flag` None: no flag forces it). What killed runs left beside it and in it is
    removed first (`sweep`), so it never counts as content."""
    out = check_folder_place(out, field)
    sweep(out, inside=True)
    if out.is_dir() and any(out.iterdir()) and not force and not (own and owner(out) == command):
        how = (f"pass {force_flag} to replace it once the new output is complete" if force_flag
               else "name a new or empty folder")
        raise OptionError(field, f"{out} exists and is not empty, and is not an earlier output of {command} ({how})")
    return out


def check_folder_place(out: str | Path, field: str = "out") -> Path:
    """Refuse, before any work, an output folder that is the current folder, one above it or the home folder, a
    symbolic link, a file, under a file or unwritable (one OptionError naming `field`); returns it expanded."""
    out = Path(out).expanduser()
    full, cwd = out.resolve(), Path.cwd().resolve()
    if full == cwd or full in cwd.parents or full == Path.home().resolve():
        raise OptionError(field, f"{out} is the current folder, one above it or the home folder: name a new folder for the output")
    if out.is_symlink():
        raise OptionError(field, f"{out} is a symbolic link: name the folder itself (the link is never replaced)")
    if out.exists() and not out.is_dir():
        raise OptionError(field, f"{out} exists and is not a folder")
    check_place(out, field)
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


def check_writable(path: str | Path, field: str) -> None:
    """Refuse, before any work, to replace the file `path` (or create it) when its folder or the file itself cannot be
    written (permissions, a read-only file system): one OptionError naming `field`."""
    path = Path(path).expanduser()
    for p in (path.parent, path) if path.exists() else (path.parent,):
        if not os.access(p, os.W_OK):
            raise OptionError(field, f"cannot write {p} (permission denied or a read-only file system)")


def not_a_link(path: str | Path, what: str = "") -> Path:
    """`path` when it is not a symbolic link; a writer never writes through a link nor replaces one (one line)."""
    path = Path(path)
    if path.is_symlink():
        pre = f"{what}: " if what else ""
        raise ToolkitError(f"{pre}{path} is a symbolic link (to {os.readlink(path)}); refusing to write through it "
                           "or replace it: name the file or folder itself")
    return path


def claim_file(out: str | Path, field: str = "out", command: str | None = None, kind: str = "JSON") -> Path:
    """Check an output *file* (a `kind` file: JSON, PNG) before any work: refuse a folder, a symlink, a path under a
    file, an unwritable place; with `command`, also an existing file that is not its earlier output (`file_owner`)."""
    out = Path(out).expanduser()
    if out.is_symlink():
        raise OptionError(field, f"{out} is a symbolic link: name the file itself (the link is never replaced)")
    if out.is_dir():
        raise OptionError(field, f"{out} is a folder: name a {kind} file")
    check_place(out, field)
    if command and out.exists() and file_owner(out) != command:
        raise OptionError(field, f"{out} exists and is not an earlier output of {command}: name a new file "
                                 "(or remove this one)")
    sweep(out)
    return out


def cache_root() -> Path:
    """The toolkit's cache: $XDG_CACHE_HOME (or ~/.cache)/dflash-toolkit (the demo target, its wheel, cost tables).
    A relative $XDG_CACHE_HOME is ignored, as the XDG specification says (it would put a cache in every folder)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "dflash-toolkit"


def temp_prefix(path: Path, kind: str = "tmp") -> str:
    """The prefix of a temp entry beside `path`: hidden, naming it, this host and this process."""
    return f".{path.name}.{kind}-{HOST}-{os.getpid()}-"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(path: str | Path, inside: bool = False) -> list[Path]:
    """Remove the temp entries beside `path` that runs of this host left when they were killed (their process is
    gone); a live run's are kept. `inside`: also those in the folder `path`, whatever they were to become (a killed
    run's temps do not make an output folder non-empty). Returns what was removed."""
    path = Path(path)
    removed = []
    try:
        siblings = list(path.parent.iterdir()) if path.parent.is_dir() else []
        siblings += list(path.iterdir()) if inside and path.is_dir() and not path.is_symlink() else []
    except OSError:
        return removed
    for p in siblings:
        m = TEMP.match(p.name)
        if not m or (m["name"] != path.name and p.parent != path) or m["host"] != HOST or alive(int(m["pid"])):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        except OSError:
            continue                    # not ours to remove after all (another user's, a read-only place)
        removed.append(p)
    return removed


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


def atomic_write(path: str | Path, write: Callable[[object], None], need: int | None = None) -> Path:
    """`write(f)` into a temp file beside `path` opened for binary writing, renamed into place once it returns:
    readers never see half a file; a failure, an interrupt or a full disk (one line) leaves nothing behind, and
    what a killed run left beside `path` is removed first (`sweep`)."""
    path = not_a_link(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, Exception) and disk_full(e):
            raise no_space(path, need) from None
        raise
    return path


def atomic_file(path: str | Path, data: str | bytes) -> Path:
    """Write a file beside `path` and rename it into place: readers never see half of it, a full disk leaves nothing."""
    raw = data.encode() if isinstance(data, str) else data
    return atomic_write(path, lambda f: f.write(raw), len(raw))


@contextmanager
def atomic_dir(out: str | Path, command: str | None = None, need: int | None = None) -> Iterator[Path]:
    """A temp folder beside `out` that replaces `out` only if the block finishes; otherwise it is removed.

    The old `out`, if any, is moved aside before the new one takes its place, so a reader never sees a half-written
    folder; the result is 0755 (mkdtemp's 0700 would hide a shared cache from other users). With `command` the
    result is marked as that command's output; a full disk is one ToolkitError naming `out` (and `need` bytes).
    What an interrupted run left beside `out` is removed first (`sweep`)."""
    out = not_a_link(out)
    if need:
        check_space(out.parent if out.parent.exists() else Path.cwd(), need)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep(out)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        if command:
            mark(tmp, command)
        os.chmod(tmp, 0o755)
        not_a_link(out)                                   # made a link while the block ran: still never replaced
        if out.is_dir():
            old = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, ToolkitError) and disk_full(e):
            raise no_space(out, need) from None
        raise
