"""Run a command that SIGKILLs itself the moment one of its temp files or folders appears under a watched folder:
what a power cut or `kill -9` leaves behind mid-write. Used by tests/test_folders.py and tests/slow/test_killed_writers.py.

    python tests/killhook.py WATCH MODULE ARGS...    # runs `python -m MODULE ARGS...`, killed at the first temp
    KILL_MATCH=.d.tmp- python tests/killhook.py ...    # killed at the first temp whose name holds `.d.tmp-`
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import tempfile
from pathlib import Path


def arm(watch: str | Path, moment: str = "appear", match: str = "") -> None:
    """SIGKILL this process once a temp entry appears under `watch` ("appear": as mkstemp/mkdtemp makes it;
    "written": as os.replace is about to move a complete one into place); with `match`, only one whose name holds it."""
    root = Path(watch).resolve()

    def watched(path) -> bool:
        p = Path(os.fsdecode(path)).resolve()
        return (p == root or root in p.parents) and match in p.name

    if moment == "appear":
        for name in ("mkstemp", "mkdtemp"):
            real = getattr(tempfile, name)

            def killing(*a, _real=real, **k):
                made = _real(*a, **k)
                if watched(made[1] if isinstance(made, tuple) else made):
                    os.kill(os.getpid(), signal.SIGKILL)
                return made

            setattr(tempfile, name, killing)
    else:
        real_replace = os.replace

        def replacing(src, dst, *a, **k):
            if ".tmp-" in os.fsdecode(src) and watched(src):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, *a, **k)

        os.replace = replacing


if __name__ == "__main__":
    watch, module, *args = sys.argv[1:]
    arm(watch, os.environ.get("KILL_AT", "appear"), os.environ.get("KILL_MATCH", ""))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
