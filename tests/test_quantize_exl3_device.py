"""experiments.quantize_exl3 shape on CPU, as its docstring runs it on a fresh device in two calls: `shape --stage`
(the synthesis, from tiny shape files here, then stop) and `shape` reusing the staged folder, with exllamav3 faked
at its seams (test_quantize_fakes); the quantize step table in $OUT/quantize_exl3.json as each step ends, and a
call cut off by timeout's SIGTERM still returning it with the step it cut."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import test_quantize_fakes as fakes
from test_quantize_pipeline import write_recipe
from test_synth import tiny_drafter, tiny_target

import experiments.quantize_exl3 as q
from toolkit.quant.run import STEPS

DONE_BEFORE_SPEED = ["validate", "plan", "target", "calibrate", "convert", "check"]


def results(out):
    return json.loads((out / "quantize_exl3.json").read_text())


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "OUT"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))     # main() sets it when unset: undone here
    return tmp_path / "OUT"


def test_stage_writes_the_inputs_and_stops(tmp_path, out, monkeypatch):
    import toolkit.quantize

    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "qwen3.6-35b-a3b.json").write_text(json.dumps(tiny_target()))
    (shapes / "qwen3.6-35b-a3b-dflash.json").write_text(json.dumps(tiny_drafter()))
    monkeypatch.setattr(q, "SHAPES", shapes)
    ran = []
    monkeypatch.setattr(toolkit.quantize, "main", lambda *a, **k: ran.append(a))
    work = tmp_path / "q36"
    assert q.main(["shape", "--stage", "--work", str(work)]) == 0
    res = results(out)
    assert ran == [] and list(res["steps"]) == ["stage"] and res["errors"] == {} and "quantize_steps" not in res
    staged = res["steps"]["stage"]["result"]
    assert staged["target"]["shards"] >= 1 and staged["draft"]["seconds"] >= 0
    target, draft = work / "target-4.0", work / "draft"
    assert json.loads((target / "config.json").read_text())["quantization_config"]["bits"] == 4.0
    assert {"config.json", "README.md", "LICENSE"} <= {p.name for p in draft.iterdir()}
    assert staged["bytes"] == {p.name: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (target, draft)}
    # a second --stage finds both and writes nothing: call 2 reuses them the same way
    before = {p: p.stat().st_mtime_ns for p in work.rglob("*")}
    assert q.main(["shape", "--stage", "--work", str(work)]) == 0
    assert set(results(out)["steps"]["stage"]["result"]) == {"bytes"}
    assert {p: p.stat().st_mtime_ns for p in work.rglob("*")} == before


def staged(tmp_path, pair, monkeypatch, bits: str | None = None):
    """What call 1 leaves in --work, from the tiny pair (the fake engine runs its target), and the recipe for it."""
    work = tmp_path / "q36"
    fakes.exl3_target(pair[0], work / "target-4.0", bits=4.0)
    shutil.copytree(pair[1], work / "draft")
    recipe = write_recipe(tmp_path / "r.toml", pair[0])
    if bits:
        recipe.write_text(recipe.read_text().replace("default = [2.0, 4.0, 8.0]", f"default = [{bits}]"))
    monkeypatch.setattr(q, "SHAPE_RECIPE", recipe)
    fakes.install(monkeypatch)
    return work, fakes.install_engine(monkeypatch, pair[0])


def at_speed(engine, out, monkeypatch, then=None) -> dict:
    """What $OUT/quantize_exl3.json holds when speed loads the target; `then()` runs right after reading it."""
    seen: dict = {}
    inner = engine.open_backend

    def spy(*a, **k):
        seen.update(results(out))
        if then:
            then()
        return inner(*a, **k)

    monkeypatch.setattr(engine, "open_backend", spy)
    return seen


def test_call_two_reuses_the_stage_and_records_each_step_as_it_ends(tmp_path, out, pair, monkeypatch):
    work, engine = staged(tmp_path, pair, monkeypatch)
    seen = at_speed(engine, out, monkeypatch)
    assert q.main(["shape", "--work", str(work)]) == 0
    # before speed started, the file already held every earlier step, the peaks so far and what runs next
    assert [r["step"] for r in seen["quantize_steps"]] == DONE_BEFORE_SPEED
    prog = seen["quantize_progress"]
    assert prog["done"] == "check" and prog["running"] == "speed" and prog["seconds"] >= prog["steps_seconds"] > 0
    assert "speed" not in seen["steps"] and "quantize" not in seen["steps"]
    res = results(out)
    assert set(res["steps"]["stage"]["result"]) == {"bytes"}              # nothing synthesised again
    rows = res["quantize_steps"]
    assert [r["step"] for r in rows] == list(STEPS) and all(r["seconds"] >= 0 for r in rows)
    assert set(rows[0]) == {"step", "seconds", "peak_allocated_gib", "peak_device_gib", "estimated_gib"}
    # the target step's phases, in GiB as its row (None: no CUDA here), saved with it as it ended
    phases = seen["quantize_steps"][2]["phases"]
    assert [p["phase"] for p in phases] == ["load", "continue", "forward", "parts"]
    assert all(set(p) == {"phase", "seconds", "peak_allocated_gib", "peak_device_gib"} and p["peak_device_gib"] is None
               for p in phases)
    assert [r["step"] for r in rows if "phases" in r] == ["target"]
    assert rows[:-1] == res["steps"]["quantize"]["result"]["steps"]      # report.json's table (written in report)
    assert res["quantize_progress"]["done"] == "report" and res["quantize_progress"]["running"] is None
    assert {p.name for p in (out / "shape").iterdir()} >= {"report.json", "report.md", "cards.tar.gz"}


def test_a_call_cut_off_by_sigterm_returns_its_step_table(tmp_path, out, pair, monkeypatch):
    work, engine = staged(tmp_path, pair, monkeypatch, bits="8.0")
    before = signal.getsignal(signal.SIGTERM)
    at_speed(engine, out, monkeypatch, then=lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert q.main(["shape", "--work", str(work)]) == 1
    res = results(out)
    assert [r["step"] for r in res["quantize_steps"]] == DONE_BEFORE_SPEED
    assert res["quantize_progress"]["cut_off"]["in_step"] == "speed" and res["quantize_progress"]["running"] == "speed"
    assert "SIGTERM at" in res["errors"]["quantize"] and "in quantize step speed" in res["errors"]["quantize"]
    assert "quantize" not in res["steps"] and "seconds" in res
    assert signal.getsignal(signal.SIGTERM) is before                   # the handler is the script's only while it runs


def test_the_sigterm_handler_saves_the_cut_off_itself(tmp_path, out, pair, monkeypatch):
    """Read right after a real SIGTERM whose SystemExit is swallowed (as cleanup that outlives the hard kill would
    leave it: nothing else saves), the file already names the step it cut and the time it came."""
    work, engine = staged(tmp_path, pair, monkeypatch, bits="8.0")
    after: dict = {}

    def swallowed():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)                                   # the handler raises before this ends
        except SystemExit as e:
            after.update(results(out), exit=str(e))

    before = at_speed(engine, out, monkeypatch, then=swallowed)
    assert q.main(["shape", "--work", str(work)]) == 0       # swallowed: the run went on to the end
    assert "cut_off" not in before["quantize_progress"]
    cut = after["quantize_progress"]["cut_off"]
    assert cut["signal"] == "SIGTERM" and cut["in_step"] == "speed" and after["exit"].endswith("in quantize step speed")
    assert after["elapsed_s"] >= cut["at_s"] >= before["elapsed_s"]
    assert [r["step"] for r in after["quantize_steps"]] == DONE_BEFORE_SPEED


def test_warm_runs_the_target_step_once_and_says_how_warm_the_cache_was(tmp_path, out, pair, monkeypatch):
    """`shape --stage --warm` (call 1 of a warm-cache run): the staged target loaded, its continuations and tap
    forwards run once through the same code as the target step, then stop; Triton's cache is under --work unless
    TRITON_CACHE_DIR says otherwise, and call 2 records how many files it found there."""
    work, engine = staged(tmp_path, pair, monkeypatch)
    monkeypatch.delenv("TRITON_CACHE_DIR")                               # unset: main() puts it under --work
    opened = []
    inner = engine.open_target
    monkeypatch.setattr(engine, "open_target", lambda *a, **k: opened.append(a) or inner(*a, **k))
    assert q.main(["shape", "--stage", "--warm", "--work", str(work)]) == 0
    res = results(out)
    assert list(res["steps"]) == ["stage", "warm"] and res["errors"] == {} and "quantize_steps" not in res
    warm = res["steps"]["warm"]["result"]
    assert list(warm["phases"]) == ["load", "continue", "forward", "parts"]
    assert warm["triton_files"] == {"before": 0, "after": 0}             # no Triton on the fake engine
    assert len(opened) == 1 and opened[0][0] == work / "target-4.0"
    assert os.environ["TRITON_CACHE_DIR"] == str(work / "triton")
    (work / "triton" / "k").mkdir(parents=True)
    (work / "triton" / "k" / "kernel.cubin").write_bytes(b"x")
    assert q.main(["shape", "--work", str(work)]) == 0
    assert results(out)["triton_files_before_quantize"] == 1
