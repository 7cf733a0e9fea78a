"""One run at a time per output: the long commands hold a lock on the folder they write (or publish) for their
whole run, so a second run on the same folder is one line naming the process that holds it.

The lock is the hidden file `.NAME.lock` beside the folder, locked with flock and holding the holder's record
(process id, host, command, start time). The system drops a lock when its process dies, so what a killed run left
(a dead process) is taken over by the next run; the file is removed when its run ends. A process may hold the
same folder again (quantize --push publishes the folder it wrote)."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import OptionError, ToolkitError

HELD: dict[str, int] = {}          # lock path -> how many blocks of this process hold it


def lock_path(folder: str | Path) -> Path:
    """The lock file of an output folder: hidden, beside it, naming it."""
    folder = Path(folder).expanduser()
    return folder.parent / f".{folder.name}.lock"


def holder_text(raw: bytes) -> str:
    """The holder's record in words ("process 123 (quantize) on host since 12:01:02"), or a plain phrase."""
    try:
        d = json.loads(raw.decode("utf-8"))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["since"])))
        return f"process {int(d['pid'])} ({d['command']}) on {d['host']} since {when}"
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return "another process"


def _open(path: Path, optional: bool) -> int | None:
    """The lock file, opened without following a link (a link is refused, as every writer refuses one); None for an
    `optional` lock in a place this user cannot write (a folder only read, such as a run to publish)."""
    if path.is_symlink():
        raise ToolkitError(f"{path} is a symbolic link (to {os.readlink(path)}); refusing to use it as a lock: "
                           "remove the link")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if optional and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        raise ToolkitError(f"cannot open the lock {path} ({e.strerror or e})") from None


def _acquire(path: Path, folder: Path, field: str, optional: bool) -> int | None:
    """An fd holding the flock of `path`, whose file is still the one at `path` (a run ending meanwhile removes it)."""
    import fcntl

    while True:
        fd = _open(path, optional)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            who = holder_text(os.pread(fd, 4096, 0))
            os.close(fd)
            raise OptionError(field, f"{folder} is in use by another run: {who}; wait for it to end") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)                               # removed by the run that held it: lock the new file


@contextmanager
def hold(folder: str | Path, command: str, field: str = "out", optional: bool = False) -> Iterator[None]:
    """Hold `folder` for `command` for the block; a folder another live run holds is one OptionError naming `field`
    and that run's process. `optional`: where no lock can be made (a read-only place), run without one."""
    import fcntl

    path = lock_path(folder)
    key = str(path.resolve())
    if HELD.get(key):
        HELD[key] += 1
        try:
            yield
        finally:
            HELD[key] -= 1
        return
    fd = _acquire(path, Path(folder), field, optional)
    if fd is None:
        yield
        return
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    HELD[key] = 1
    try:
        yield
    finally:
        del HELD[key]
        try:
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                os.unlink(path)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
