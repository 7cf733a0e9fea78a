"""Two bitrates converted at once when two converters fit the memory budget, one at a time when not: the schedule,
the order of the results, a failure of one of two, an interrupt, and the converter's estimate (the converter faked
at run_converter as test_quantize_fakes fakes it, each call held briefly so that concurrent ones overlap)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import test_quantize_fakes as fakes
from test_quantize_pipeline import run
from toolkit.core.errors import ToolkitError
from toolkit.dflash import DFlashConfig
from toolkit.quant import convert as conv
from toolkit.quant import memory as mem
from toolkit.quant.plan import PlanItem

GIB = 1024**3
SHAPES = Path(__file__).resolve().parents[1] / "quantize" / "shapes"


def overlapping(monkeypatch, modes=None, delay: dict[float, float] | None = None) -> dict:
    """The converter fake, counting how many run at once; each call is held 0.3 s (or delay[bits]) first."""
    fakes.install(monkeypatch, modes)
    inner, lock, seen = conv.run_converter, threading.Lock(), {"now": 0, "max": 0, "ended": []}

    def counted(args, log_path):
        bits = float(args[args.index("-b") + 1])
        with lock:
            seen["now"] += 1
            seen["max"] = max(seen["max"], seen["now"])
        try:
            time.sleep((delay or {}).get(bits, 0.3))
            return inner(args, log_path)
        finally:
            with lock:
                seen["now"] -= 1
                seen["ended"].append(bits)

    monkeypatch.setattr(conv, "run_converter", counted)
    return seen


def resident(pair) -> int:
    """The BF16 target's weights, which stay on the GPU through the convert step."""
    return mem.hf_weights(pair[0], json.loads((pair[0] / "config.json").read_text()))


def test_two_at_once_when_they_fit(tmp_path, pair, monkeypatch):
    seen = overlapping(monkeypatch)
    report = run(tmp_path, pair, bits="2,4,8", check=False, calibrate=False)
    out = tmp_path / "out"
    assert seen["max"] == 2 and sorted(seen["ended"]) == [2.0, 4.0, 8.0]
    assert [r["folder"] for r in report["results"]] == ["2.0bpw", "4.0bpw", "8.0bpw"]  # plan order
    assert all((out / f / ".quantize.json").is_file() for f in ("2.0bpw", "4.0bpw", "8.0bpw"))
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")] and not list((out / ".work").glob("*bpw"))
    assert sorted(p.name for p in (out / ".work").glob("*.log")) == ["2.0bpw.log", "4.0bpw.log", "8.0bpw.log"]
    row = {s["step"]: s for s in report["steps"]}["convert"]
    one = sum(mem.converter(DFlashConfig.from_dir(pair[1])).values())
    assert row["estimated_bytes"] == resident(pair) + 2 * one + mem.RESERVE              # both converters planned


def test_one_at_a_time_when_two_do_not_fit(tmp_path, pair, monkeypatch):
    one = sum(mem.converter(DFlashConfig.from_dir(pair[1])).values())
    monkeypatch.setattr(mem, "CARD_24GB", one + mem.RESERVE + GIB)                     # room for one converter only
    seen = overlapping(monkeypatch)
    report = run(tmp_path, pair, bits="2,4,8", check=False, calibrate=False)
    assert seen["max"] == 1 and seen["ended"] == [2.0, 4.0, 8.0]
    assert [r["folder"] for r in report["results"]] == ["2.0bpw", "4.0bpw", "8.0bpw"]
    assert {s["step"]: s for s in report["steps"]}["convert"]["estimated_bytes"] == resident(pair) + one + mem.RESERVE


def test_dry_run_says_how_many_convert_at_once(tmp_path, pair, monkeypatch, capsys):
    from test_quantize_pipeline import write_recipe
    from toolkit.quantize import main

    args = ["--recipe", str(write_recipe(tmp_path / "r.toml", pair[0])), "--model", str(pair[1]), "--dry-run",
            "--out", str(tmp_path / "o"), "--no-check", "--no-calibrate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "converts at once: 2 " in out and f"{mem.SECOND} " in out
    assert main([*args, "--bits", "4"]) == 0                                            # one bitrate: one converter
    out = capsys.readouterr().out
    assert "converts at once: 1 " in out and mem.SECOND not in out


def test_a_failure_of_one_of_two_stops_after_the_other_finishes(tmp_path, pair, monkeypatch):
    seen = overlapping(monkeypatch, {4.0: "crash"}, delay={2.0: 0.8, 4.0: 0.1})
    with pytest.raises(ToolkitError, match=r"^converter crashed on 4.0bpw \(exit -11") as e:
        run(tmp_path, pair, bits="2,4,8", check=False, calibrate=False)
    assert "\n" not in str(e.value)
    out = tmp_path / "out"
    # 2.0 ran on to its end (kept for a resume), 8.0 never started, 4.0 left nothing behind
    assert seen["ended"] == [4.0, 2.0] and (out / "2.0bpw" / ".quantize.json").is_file()
    assert not [p.name for p in out.iterdir() if "4.0bpw" in p.name or "8.0bpw" in p.name]
    assert (out / ".work" / "4.0bpw.log").is_file()                                     # its log stays, as today
    calls = fakes.install(monkeypatch)
    run(tmp_path, pair, bits="2,4,8", check=False, calibrate=False)
    assert sorted(c["bits"] for c in calls) == [4.0, 8.0]


def test_two_failures_raise_the_first_in_plan_order(tmp_path, pair, monkeypatch):
    seen = overlapping(monkeypatch, {2.0: "crash", 4.0: "disk"}, delay={2.0: 0.8, 4.0: 0.1})
    with pytest.raises(ToolkitError, match=r"^converter crashed on 2.0bpw"):
        run(tmp_path, pair, bits="2,4,8", check=False, calibrate=False)
    assert seen["ended"] == [4.0, 2.0]                                                  # 4.0 failed first
    assert not [p for p in (tmp_path / "out").iterdir() if "bpw" in p.name]


def test_an_interrupt_terminates_the_running_converters(tmp_path, monkeypatch):
    """Real subprocesses (a converter that sleeps): the interrupt ends both, starts none, and is raised."""
    (tmp_path / "slow_converter.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(conv, "CONVERTER", "slow_converter")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    started, codes = [], []

    def convert_one(item):
        started.append(item.folder)
        codes.append(conv.run_converter([], tmp_path / f"{item.folder}.log"))
        if codes[-1]:
            raise ToolkitError(f"converter crashed on {item.folder}")

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop()

    before = signal.signal(signal.SIGUSR1, stop)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGUSR1))
    items = [PlanItem(b, True, f"{b}bpw", f"{b}bpw", 0) for b in (2.0, 4.0, 8.0)]
    t0 = time.time()
    try:
        timer.start()
        with pytest.raises(Stop):
            conv.convert_all(items, convert_one, at_once=2, progress=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, before)
    assert time.time() - t0 < 20 and started == ["2.0bpw", "4.0bpw"]
    assert codes == [-signal.SIGTERM] * 2 and not conv.RUNNING and all(i.status != "done" for i in items)


def test_the_second_converter_waits_when_the_gpu_lacks_room_now(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert conv.at_once_now(2, 8 * GIB, "cuda") == 2                                    # no CUDA: the plan's count
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: asked.append(i) or (20 * GIB, 80 * GIB))
    assert conv.at_once_now(2, 8 * GIB, "cuda:1") == 2 and asked == [1]
    assert conv.at_once_now(2, 12 * GIB, "cuda:1") == 1 and conv.at_once_now(1, GIB, None) == 1


def test_the_converter_estimate_matches_the_measured_peaks():
    """One converter beside this process: 9.46 GiB device peak for the Qwen3.6 drafter on the H200 (2026-12-03)."""
    draft = json.loads((SHAPES / "qwen3.6-35b-a3b-dflash.json").read_text())
    draft.pop("_source", None)
    c = DFlashConfig.from_dict(draft)
    one = mem.convert_need(c, {}, 1)
    assert abs(one.total / GIB - 9.46) < 0.1 and mem.SECOND not in one.parts
    two = mem.convert_need(c, {}, 5)
    assert two.parts[mem.SECOND] == one.total - mem.RESERVE and two.total <= 22 * GIB and mem.at_once([two]) == 2
    # what stays resident counts: a BF16 target of 5 GiB leaves room for one converter only
    held = mem.convert_need(c, {"target weights": 5 * GIB}, 5)
    assert mem.SECOND not in held.parts and mem.at_once([held]) == 1
    assert [n.parts for n in mem.alone([two])] == [one.parts]

