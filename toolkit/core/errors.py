"""One error type for bad input: the CLIs print its message on one line and exit non-zero."""

from __future__ import annotations

import errno
import signal
import sys
import threading
from typing import Callable


class ToolkitError(Exception):
    """A user-facing error. Its message is one line that says what is wrong and with which value."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class OptionError(ToolkitError):
    """Bad value of one option, named by its field (`max_new_tokens`); a command re-words it with its flag."""

    def __init__(self, field: str, message: str):
        self.field = field
        message = " ".join(str(message).split())
        self.rest = (" " if message[:1].isalpha() else ": " if message[:1] not in ":," else "") + message
        super().__init__(f"{field}{self.rest}")


def disk_full(e: BaseException | None) -> bool:
    """True when `e` (or what caused it) is a full disk: an OSError ENOSPC or EDQUOT, or a writer's own wording of
    one (torch.save and safetensors raise RuntimeErrors that quote the system's message)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def close_bars() -> None:
    """Close every open tqdm bar, so that an error line is never glued to a bar and is the last line of stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:
            pass


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, systemd and Spaces send), raised where the program is, as Ctrl-C's KeyboardInterrupt
    is: every temp file and folder is removed on the way out and the user's output is left as it was."""


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)      # a second SIGTERM must not cut the clean-up short
    raise Terminated


def run_cli(main: Callable[[], object]) -> None:
    """Run a CLI entry point: a ToolkitError becomes `error: <message>` on stderr and exit 2; Ctrl-C and SIGTERM
    end it with `error: interrupted` (exit 130, or 143 for SIGTERM) once the temp files are removed."""
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        result = main()
    except ToolkitError as e:
        close_bars()
        sys.stderr.flush()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:    # a path option or a path read from a file
            close_bars()
            name = str(e.filename or "")
            print(f"error: a file name is too long for this system: {name[:60]}{'...' if len(name) > 60 else ''}",
                  file=sys.stderr)
            sys.exit(2)
        if not disk_full(e):             # a full disk that no writer turned into its own line yet
            raise
        close_bars()
        where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error: no space left on the device{where}; free some space and run the command again", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        close_bars()
        term = isinstance(e, Terminated)
        print(f"error: interrupted{' (SIGTERM)' if term else ''}", file=sys.stderr)
        sys.exit(143 if term else 130)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)
