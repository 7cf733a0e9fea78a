"""One run per output folder (core.locks): the long commands hold their folder for the whole run, a second run on it
is one line naming the process that holds it, and a lock whose process was killed is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz_harness import main_of, run_case, stubs, write_run  # noqa: F401  (stubs: a fixture)
from test_card import sample_report
from toolkit.core.errors import OptionError
from toolkit.core.locks import hold, lock_path

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
HOLDER = ("import sys, time\nsys.path.insert(0, sys.argv[3])\nfrom toolkit.core.locks import hold\n"
          "with hold(sys.argv[1], sys.argv[2]):\n    print('held', flush=True)\n    time.sleep(600)\n")


@pytest.fixture
def holder():
    """Start a process that holds a folder for a command; yields (start, the processes started)."""
    procs = []

    def start(folder: Path, command: str = "quantize") -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), command, str(ROOT)], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_held_folder_is_refused_naming_the_process(tmp_path, holder):
    out = tmp_path / "run"
    p = holder(out, "quantize")
    with pytest.raises(OptionError, match=rf"^out: .*run is in use by another run: process {p.pid} \(quantize\) on "):
        with hold(out, "quantize"):
            pass
    assert lock_path(out).exists() and not out.exists()


def test_a_lock_left_by_a_killed_run_is_taken_over_and_removed_at_the_end(tmp_path, holder):
    out = tmp_path / "run"
    p = holder(out)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert json.loads(lock_path(out).read_text())["pid"] == p.pid          # the dead run's record is still there
    with hold(out, "push"):
        assert json.loads(lock_path(out).read_text()) | {"since": 0} == {
            "pid": os.getpid(), "host": json.loads(lock_path(out).read_text())["host"], "command": "push", "since": 0}
        with hold(out, "push"):                                               # this process again (quantize --push)
            pass
        assert lock_path(out).exists()
    assert not lock_path(out).exists() and sorted(tmp_path.iterdir()) == []


def test_a_lock_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text("x")
    lock_path(tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Exception, match="is a symbolic link"):
        with hold(tmp_path / "run", "quantize"):
            pass
    assert (tmp_path / "elsewhere").read_text() == "x"


def test_an_optional_lock_in_a_read_only_place_runs_without_one(tmp_path, monkeypatch):
    import errno

    from toolkit.core import locks
    from toolkit.core.errors import ToolkitError

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(locks.os, "open", read_only)
    ran = []
    with hold(tmp_path / "run", "push", optional=True):          # push reads a run it may not write beside
        ran.append(1)
    assert ran == [1] and not lock_path(tmp_path / "run").exists()
    with pytest.raises(ToolkitError, match=r"cannot open the lock .*\.run\.lock \(Read-only file system\)"):
        with hold(tmp_path / "run", "quantize"):
            pass


LONG = {
    "quantize": (["--model", str(PAIR / "draft"), "--bits", "4", "--out", "{out}", "--no-calibrate", "--no-check",
                  "--device", "cpu"], "--out"),
    "train_drafter": (["--target", str(PAIR / "target"), "--out", "{out}", "--chat", "8", "--code", "8", "--steps", "2",
                       "--quiet"], "--out"),
    "train_drafter --checkpoint-dir": (["--target", str(PAIR / "target"), "--out", "{out}.d", "--checkpoint-dir",
                                        "{out}", "--chat", "8", "--code", "8", "--steps", "2", "--quiet"],
                                       "--checkpoint-dir"),
    "preview_run": (["--out", "{out}"], "--out"),
    "space": (["export", "{out}"], "DIR"),
    "push": (["--repo", "alice/x", "--from", "{out}", "--retries", "0"], "--from"),
}


@pytest.mark.parametrize("cmd", sorted(LONG))
def test_each_long_command_refuses_a_held_folder_before_its_work(cmd, tmp_path, holder, monkeypatch, stubs):  # noqa: F811
    out = tmp_path / "out"
    if cmd == "push":
        write_run(out, sample_report(0))
    p = holder(out, "someone")
    argv, flag = LONG[cmd]
    case = tmp_path / "case"
    case.mkdir()
    r = run_case(main_of(cmd.split()[0], None), [a.format(out=out) for a in argv], case, monkeypatch)
    last = r["stderr"].strip().splitlines()[-1]
    assert r["code"] == 2 and r["exc"] is None and "Traceback" not in r["stderr"], r
    assert last.startswith(f"error: {flag}: ") and f"in use by another run: process {p.pid} (someone)" in last, last
