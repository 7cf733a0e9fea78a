"""experiments/ on the CPU, so the device scripts do not rot between device runs. The one test that imports
experiments: every module imports without exllamav3 or CUDA, every script answers --help and is listed in
experiments/README.md, none edits sys.path; then a minimal check of each script's own logic on stand-ins (the
shared harness, the Generator-loop timing, speed's interleaved timing and the pair's targets, draft_step's timing
loop, draft_exl3's folder protocol, round_trace, quantize_exl3's step table and smol_scale's device calls)."""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from exl3_fakes import FakeGenerator, ar_reference, make_backend, timed_backend
from stream_shape import assert_stream_shape

import experiments
from experiments.exl3_timing import run_jobs
from experiments.harness import Run
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "experiments"
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]))
LIBRARIES = {"harness", "exl3_timing", "lossless", "draft_exl3", "pair_mode", "budget"}      # imported by the scripts, not run
SCRIPTS = [m for m in MODULES if m not in LIBRARIES]


def test_the_package_holds_the_expected_modules():
    assert LIBRARIES <= set(MODULES)
    assert {"device_check", "speed", "draft_step", "app_device", "quantize_device", "quantize_exl3", "smol_device",
            "smol_scale", "smol_exl3", "two_gpu", "round_trace", "policy_replay"} <= set(SCRIPTS)
    assert Path(experiments.__file__).parent == HERE


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_and_edits_no_sys_path(name):
    mod = importlib.import_module(f"experiments.{name}")
    assert mod.__doc__ and len(mod.__doc__.strip()) > 40, f"{name} needs a docstring saying what it measures"
    assert "sys.path" not in (HERE / f"{name}.py").read_text()


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_answers_help(name, capsys):
    mod = importlib.import_module(f"experiments.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m experiments.{name}"), out[:200]


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_runs_main_as_a_module(name):
    tree = ast.parse((HERE / f"{name}.py").read_text())
    guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guard and "main" in ast.unparse(guard[0]), f"{name} needs `if __name__ == '__main__': ... main()`"


def test_readme_lists_every_module():
    readme = (HERE / "README.md").read_text()
    for name in SCRIPTS:
        assert f"python -m experiments.{name}" in readme, f"experiments/README.md does not list {name}"
    for name in LIBRARIES:
        assert f"`{name}`" in readme, f"experiments/README.md does not list the shared module {name}"


def test_modules_import_without_exllamav3_and_run_with_dash_m():
    code = ("import sys, importlib; [importlib.import_module('experiments.' + m) for m in sys.argv[1:]]; "
            "print('exllamav3' in sys.modules)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code, *MODULES], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
    run = subprocess.run([sys.executable, "-m", "experiments.device_check", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and "usage: python -m experiments.device_check" in run.stdout, run.stderr[-2000:]


# -- the harness ----------------------------------------------------------------------------------------


def test_run_writes_partial_results_records_errors_and_goes_on(tmp_path, capsys):
    run = Run("r.json", out=tmp_path, section="checks")

    def second():
        on_disk = json.loads((tmp_path / "r.json").read_text())       # the first step is saved before the next runs
        assert on_disk["checks"]["first"]["result"] == {"x": 1}
        raise ValueError("boom")

    def leaves():
        raise SystemExit(3)

    assert run.step("first", lambda: {"x": 1}) == {"x": 1}
    assert run.step("second", second) is None
    assert run.step("exits", leaves) is None
    assert run.step("third", lambda a, b=0: a + b, 2, b=3) == 5
    assert run.finish() == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["checks"]) == {"first", "third"} and data["checks"]["third"]["result"] == 5
    assert "ValueError: boom" in data["errors"]["second"] and "Traceback" in data["errors"]["second"]
    assert "SystemExit: 3" in data["errors"]["exits"]
    assert data["seconds"] >= 0 and "elapsed_s" in data
    log = capsys.readouterr().out
    assert "s] begin first" in log and "FAILED second" in log and "done; errors:" in log
    assert not list(tmp_path.glob(".*.tmp"))


def test_run_budget_skips_steps_that_do_not_fit(tmp_path):
    run = Run("b.json", budget_s=5, out=tmp_path)
    ran = []
    assert run.step("fits", lambda: ran.append(1) or "ok", need_s=1) == "ok"
    assert run.step("too_long", lambda: ran.append(2), need_s=60) is None
    run.budget_s = -1                                                  # spent: nothing new starts
    assert run.step("after", lambda: ran.append(3)) is None
    assert ran == [1]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["errors"]["too_long"].startswith("skipped:") and "needs about 60 s" in data["errors"]["too_long"]
    assert data["errors"]["after"].startswith("skipped:")
    run.budget_s = float("inf")
    assert run.step("live", object, keep=False) is not None and "live" not in run.steps


def test_repetitions_start_only_what_still_fits(tmp_path, monkeypatch, capsys):
    import experiments.harness as harness

    run = Run("r.json", out=tmp_path)
    clock = itertools.chain([0.0, 4.0, 10.0, 13.0], itertools.repeat(20.0))   # laps of 4 s, then 3 s
    monkeypatch.setattr(harness.time, "time", lambda: next(clock))
    left = itertools.chain([100.0], itertools.repeat(5.3))             # the third needs 4 * 1.1 + 1 = 5.4 s
    monkeypatch.setattr(run, "left", lambda: next(left))
    reps = harness.Repetitions(run, 5, reserve_s=1.0)
    done = [(rep, reps.lap()) for rep in reps]
    assert done == [(0, 4.0), (1, 4.0)] and "stopping after 2 repetitions" in capsys.readouterr().out


def test_run_goes_to_dollar_out(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    run = Run("x.json")
    run.save()
    assert (tmp_path / "o" / "x.json").is_file()


# -- the Generator-loop timing (stand-in Generator) ---------------------------------------------------------


@pytest.fixture
def fake_backend(monkeypatch, tmp_path):
    return make_backend(monkeypatch, tmp_path)


PROMPTS = [[1, 2, 3], [4, 9], [20, 21, 22, 23], [30]]


def test_plain_loop_emits_the_ar_tokens(fake_backend):
    loop = run_jobs(fake_backend, PROMPTS, GenSettings(max_new_tokens=40, block_size=6), hooked=False)
    assert loop.tokens == [ar_reference(p, 40) for p in PROMPTS]
    assert loop.rounds == [] and loop.iterations == len(loop.iterate_s) == len(loop.post_s) > 1
    assert loop.seconds >= sum(loop.iterate_s) > 0


def test_hooked_loop_with_rounds_is_generate_many(fake_backend):
    st = GenSettings(max_new_tokens=40, block_size=6)
    loop = run_jobs(fake_backend, PROMPTS, st)
    per_job = {i: [r for j, r in loop.rounds if j == i] for i in range(len(PROMPTS))}
    many = {i: [] for i in range(len(PROMPTS))}
    for i, r in fake_backend.generate_many(PROMPTS, st):
        many[i].append(r)
    for i, p in enumerate(PROMPTS):
        assert tokens_of(per_job[i]) == loop.tokens[i] == ar_reference(p, 40) == tokens_of(many[i])
        assert [r.accepted for r in per_job[i]] == [r.accepted for r in many[i]]
        assert_stream_shape(per_job[i], width=5, max_new_tokens=40)
    assert 0 < loop.overhead_s <= loop.seconds
    hook_only = run_jobs(fake_backend, PROMPTS, st, rounds=False)
    assert hook_only.rounds == [] and hook_only.tokens == loop.tokens


def test_max_steps_stops_early_and_frees_the_jobs(fake_backend):
    loop = run_jobs(fake_backend, PROMPTS, GenSettings(max_new_tokens=40, block_size=6), max_steps=3)
    assert loop.iterations == 3 and len(loop.iterate_s) == 3
    assert fake_backend._gen.num_remaining_jobs() == 0
    assert all(0 < len(t) < 40 for t in loop.tokens)


def test_capture_errors_raise_or_are_recorded(fake_backend, monkeypatch):
    import experiments.exl3_timing as timing

    def broken(*a, **k):
        raise RuntimeError("capture out of step")

    monkeypatch.setattr(timing, "build_round", broken)
    st = GenSettings(max_new_tokens=20, block_size=6)
    with pytest.raises(RuntimeError, match="capture out of step"):
        run_jobs(fake_backend, PROMPTS, st)
    loop = run_jobs(fake_backend, PROMPTS, st, keep_going=True)
    assert loop.capture_error == "capture out of step" and loop.rounds == []
    assert loop.tokens == [ar_reference(p, 20) for p in PROMPTS]


def test_quantize_exl3_keeps_what_out_takes_back(tmp_path, monkeypatch):
    """The pair's 13 cards travel as one archive: $OUT takes back 8 files, and report.json must be among them."""
    import tarfile

    import experiments.quantize_exl3 as q
    import toolkit.quantize

    out = tmp_path / "out"
    for name in [f"{b}bpw{u}" for b in (2.0, 3.0, 4.0, 5.0, 6.0, 8.0) for u in ("", "-uncal")] + ["upstream"]:
        (out / name).mkdir(parents=True)
        (out / name / "README.md").write_text(f"card {name}")
    (out / "report.json").write_text("{}")
    (out / "report.md").write_text("report")
    monkeypatch.setattr(toolkit.quantize, "main", lambda argv, on_step=None: None)
    res = q.quantize_run(Path("r.toml"), tmp_path, tmp_path, out, tmp_path / "keep", [])
    kept = sorted(p.name for p in (tmp_path / "keep").iterdir())
    assert res["verdict"] == "pass" and kept == ["cards.tar.gz", "report.json", "report.md"]
    with tarfile.open(tmp_path / "keep" / "cards.tar.gz") as tar:
        names = tar.getnames()
        assert len(names) == 13 and tar.extractfile("card-4.0bpw.md").read() == b"card 4.0bpw"


# -- speed: the interleaved timing loop on the stand-in, the projection, the pair's targets ------------------------


def test_speed_shape_interleaves_settings_keeps_partial_results_and_projects(monkeypatch, tmp_path):
    from experiments.speed import projection_rows, time_shape

    # AR (no drafter) costs 8 ms; a speculative round 10 + 2 w c ms, or 10 + w c ms with the lever
    be = timed_backend(monkeypatch, tmp_path, lambda w, rows: 10.0 + 2.0 * w * rows)
    real_generator = be.generator

    def generator(width, hooked=True):
        g = real_generator(width, hooked)
        if g.draft_model is None:
            g.cost = lambda w, rows: 8.0
        elif be.options.graph_draft_swa:
            g.cost = lambda w, rows: 10.0 + 1.0 * w * rows
        return g

    be.generator = generator
    a = argparse.Namespace(concurrency=[1, 4], widths=[0, 1, 3, 7], levers=["graph_draft_swa"], reps=3, passes=1,
                           context=32, reserve_s=0.0, warmup=1)
    run = Run("speed.json", out=tmp_path / "out")
    data = time_shape(run, be, a)
    assert data["ar"] == {1: [pytest.approx(8.0)] * 3, 4: [pytest.approx(8.0)] * 3}
    for c in (1, 4):
        assert data["sets"]["stock"][c][7] == [pytest.approx(10.0 + 14.0 * c)] * 3
        assert data["sets"]["graph_draft_swa"][c][3] == [pytest.approx(10.0 + 3.0 * c)] * 3
    saved = json.loads(run.path.read_text())["timing"]                      # written after every repetition
    assert saved["reps_done"] == 3 and saved["settings"] == ["stock", "graph_draft_swa"]
    assert len(saved["warmup_seconds"]) == 1                                # one untimed pass, not among the 3
    assert saved["round_ms"]["stock"]["4"]["7"]["median"] == pytest.approx(66.0) and be.options.tag == "stock"
    rows = projection_rows(data["ar"], data["sets"], [("x", 3.439, 4)])
    r = next(r for r in rows if r["setting"] == "stock" and r["concurrency"] == 1)
    # w = 0..3 cost 10, 12, 14, 16 ms (w = 2 interpolated); alpha 0.9: (1 + .9 + .81 + .729) / 16 ms is the best
    assert r["policy_width"] == 3 and r["policy_speedup"] == pytest.approx(3.439 / 16 * 8)


def test_pair_targets_read_the_paired_ratio_and_ignore_lever_cells():
    from experiments.pair_mode import pair_targets

    cells = [{"concurrency": 1, "block_size": "auto", "tok_s": 200.0, "speedup": 2.2, "lossless": 1.0},
             {"concurrency": 1, "block_size": 8, "tok_s": 205.0, "speedup": 2.05, "lossless": 1.0},
             {"concurrency": 8, "block_size": "auto", "tok_s": 900.0, "speedup": 0.9, "lossless": 1.0},
             {"concurrency": 8, "block_size": 8, "tok_s": 1000.0, "speedup": 1.0, "lossless": 1.0},
             {"concurrency": 8, "block_size": 8, "tok_s": 2000.0, "speedup": 2.0, "lossless": 1.0, "lever": "x"}]
    t = pair_targets({"concurrency": [1, 8], "cells": cells})
    assert t["1"] == {"auto_speedup": 2.2, "auto_over_best_fixed": 200 / 205, "lossless": 1.0, "not_slower_than_ar": True,
                      "within_3pct_of_best_fixed": True, "at_least_2x_ar": True}
    assert t["8"]["not_slower_than_ar"] is False and t["8"]["within_3pct_of_best_fixed"] is False   # lever cells do not count
    paired = {"block_size": 8, "ratios": [0.99, 0.97, 1.02], "n": 3, "median": 0.99, "min": 0.97, "max": 1.02}
    cells[2] = {**cells[2], "auto_over_best_fixed": paired}                 # c=8: paired rep by rep, 0.99
    t = pair_targets({"concurrency": [1, 8], "cells": cells})
    assert t["8"]["auto_over_best_fixed"] == 0.99 and t["8"]["within_3pct_of_best_fixed"] is True


# -- draft_step: the drafter step timed per concurrency and setting, interleaved --------------------------------


def test_draft_step_times_fresh_jobs_per_concurrency_and_repetition(monkeypatch, tmp_path):
    from experiments.draft_step import measure

    be = make_backend(monkeypatch, tmp_path)
    be.draft.modules, be.draft.sample_from_state = [], lambda state, params: state
    a = types.SimpleNamespace(concurrency=[1, 4], reps=3, rounds=4, context=64, profile_rounds=4, reserve_s=0.0,
                              levers=["graph_draft_swa"])
    seen = []
    be.set_options, set_options = (lambda o: (seen.append(o.tag), set_options(o))), be.set_options
    out = measure(Run("draft_step.json", out=tmp_path), be, a)
    cells = ("c1", "c4", "graph_draft_swa/c1", "graph_draft_swa/c4")
    assert out["reps_done"] == 3 and set(out) >= set(cells)
    assert all(len(out[k]["step_ms_reps"]) == 3 and out[k]["step_ms"] >= 0 for k in cells)
    assert seen[:4] == ["stock", "graph_draft_swa"] * 2 and be.options.tag == "stock"   # interleaved, then reset
    assert all(g.num_remaining_jobs() == 0 for g in FakeGenerator.built)     # every job set was cleared
    assert (tmp_path / "draft_step.json").is_file()


# -- draft_exl3: the converter replaced, the folder protocol checked ---------------------------------------------


def test_draft_exl3_converts_once_pins_tap_shift_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    import experiments.draft_exl3 as dx

    src = tmp_path / "draft"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"dflash_config": {"tap_shift": 1}}))
    (src / "heldout.json").write_text("{}")
    calls = []

    def fake(args, log):
        out = Path(args[args.index("-o") + 1])
        calls.append(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3"}}))
        return 0

    monkeypatch.setattr(dx, "run_converter", lambda args, log: 3)
    with pytest.raises(ToolkitError, match="failed \\(exit 3\\)"):
        dx.exl3_draft(src, tmp_path / "draft-6bpw", 6)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".log")) == ["draft"]
    monkeypatch.setattr(dx, "run_converter", fake)
    out = tmp_path / "draft-6bpw"
    assert dx.exl3_draft(src, out, 6) == out and dx.exl3_draft(src, out, 6) == out
    assert len(calls) == 1                                   # complete: reused
    assert json.loads((out / "config.json").read_text())["dflash_config"]["tap_shift"] == 1
    assert (out / "heldout.json").is_file() and float(calls[0][calls[0].index("-b") + 1]) == 6.0
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.work"))


# -- round_trace: every iterate() a row of its bench cell; the CLI renders a trace file ---------------------------


def test_round_trace_rows_add_up_to_the_decoded_tokens(monkeypatch, tmp_path):
    import toolkit.benchmark.grid as bg
    from exl3_fakes import Clock
    from experiments.round_trace import RoundTrace, summarize

    monkeypatch.setattr(FakeGenerator, "clock", Clock())
    trace = RoundTrace().install()
    try:
        be = make_backend(monkeypatch, tmp_path)
        rounds, _ = bg.run_jobs(be, [[11, 12], [13, 14]], GenSettings(max_new_tokens=40, block_size=8, stop_ids=()), True)
    finally:
        trace.remove()
    mine = [r for r in trace.rows if r["cell"] == "8/c2/n40"]
    assert summarize(trace.rows)["8/c2/n40"]["rounds"] == len(mine) > 0
    assert sum(r["emitted"] for r in mine) == sum(len(r.tokens) for job in rounds for r in job) == 80
    assert {r["w"] for r in mine if r["rows"]} == {7} and [r["t"] for r in trace.rows] == sorted(r["t"] for r in trace.rows)


def test_round_trace_cli_renders_a_trace_and_refuses_other_files(tmp_path, capsys):
    import gzip

    from experiments.round_trace import main, summarize

    rows = [{"cell": "8/c1/n96", "t": 0.0, "w": 7, "rows": 1, "jobs": 1, "ms": 10.0, "emitted": 3},
            {"cell": "8/c1/n96", "t": 0.0105, "w": 7, "rows": 1, "jobs": 1, "ms": 12.0, "emitted": 1},
            {"cell": "auto/c1/n96", "t": 0.03, "w": 3, "rows": 1, "jobs": 1, "ms": 8.0, "emitted": 2}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = summarize(rows)
    assert cells["8/c1/n96"]["gap_ms"] == pytest.approx(0.5) and cells["8/c1/n96"]["tokens_per_ms"] == pytest.approx(4 / 22.5, abs=1e-4)
    assert cells["8/c1/n96"]["one_job"] == {7: {"rounds": 2, "median_ms": 11.0, "tokens_per_round": 2.0}}
    assert main([str(trace), "--cells", "auto"]) == 0
    out = capsys.readouterr().out
    assert "| auto/c1/n96 | 1 | 2 | 8 |" in out and "8/c1/n96" not in out
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    assert main([str(packed), "--cells", "auto"]) == 0 and capsys.readouterr().out == out
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main([str(tmp_path / "bad.jsonl")]) == 2 and main([str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.count("error: ") == 2


# -- quantize_exl3: the step table in $OUT as each quantize step ends, kept when SIGTERM cuts the call -----------


def test_quantize_exl3_cut_off_by_sigterm_returns_its_step_table(tmp_path, pair, monkeypatch):
    import signal

    import test_quantize_fakes as fakes
    from test_quantize_pipeline import write_recipe

    import experiments.quantize_exl3 as q

    out = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))     # main() sets it when unset: undone here
    work = tmp_path / "q36"                                               # what call 1 (--stage) leaves
    fakes.exl3_target(pair[0], work / "target-4.0", bits=4.0)
    shutil.copytree(pair[1], work / "draft")
    recipe = write_recipe(tmp_path / "r.toml", pair[0])
    recipe.write_text(recipe.read_text().replace("default = [2.0, 4.0, 8.0]", "default = [8.0]"))
    monkeypatch.setattr(q, "SHAPE_RECIPE", recipe)
    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    seen, inner = {}, engine.open_backend

    def cut(*a, **k):                                                      # speed starts: the call is cut off here
        seen.update(json.loads((out / "quantize_exl3.json").read_text()))
        os.kill(os.getpid(), signal.SIGTERM)
        return inner(*a, **k)

    monkeypatch.setattr(engine, "open_backend", cut)
    before = signal.getsignal(signal.SIGTERM)
    assert q.main(["shape", "--work", str(work)]) == 1
    done = ["validate", "plan", "target", "calibrate", "convert", "check"]
    assert [r["step"] for r in seen["quantize_steps"]] == done and seen["quantize_progress"]["running"] == "speed"
    res = json.loads((out / "quantize_exl3.json").read_text())
    assert [r["step"] for r in res["quantize_steps"]] == done and res["quantize_progress"]["cut_off"]["in_step"] == "speed"
    assert "SIGTERM at" in res["errors"]["quantize"] and "quantize" not in res["steps"]
    assert signal.getsignal(signal.SIGTERM) is before                   # the handler is the script's only while it runs


# -- smol_scale: gen then train (--quick: CPU, a tiny target), the store kept and a later train continuing ---------


def test_smol_scale_runs_its_device_calls_tiny(tmp_path, monkeypatch):
    from experiments import smol_scale
    from toolkit.assets.fixtures import build
    from toolkit.train.data import Item, write_pool

    target, _ = build(tmp_path / "models", "llama", 16, 0)
    pool = [Item(f"Tell me about item number {i} in the list of things.", "chat") for i in range(200)]
    pool += [Item(f"def f{i}(x):\n    return x * {i} + 1\n", "code") for i in range(100)]
    write_pool(tmp_path / "pool.jsonl.gz", pool)
    common = ["--quick", "--target", str(target), "--work", str(tmp_path / "work")]
    monkeypatch.setenv("OUT", str(tmp_path / "out1"))
    assert smol_scale.main(["gen", *common, "--pool", str(tmp_path / "pool.jsonl.gz"), "--batch", "4"]) == 0
    gen = json.loads((tmp_path / "out1" / "gen.json").read_text())["stages"]["generate"]["result"]
    assert gen["answered"] == 8 and gen["pending"] == 0 and gen["answers_per_s"] > 0
    monkeypatch.setenv("OUT", str(tmp_path / "out2"))
    assert smol_scale.main(["train", *common]) == 0
    out = tmp_path / "out2"
    res = json.loads((out / "results.json").read_text())
    assert res["stages"]["train"]["result"]["steps"] == 6 and set(res["tau"]) == {"chat", "code"}
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and "curve.png" in names and "model-00001-of-00002.safetensors" in names
    # the store comes back as parts, is kept, and a later train unpacks it and continues the drafter
    assert [p.name for p in (tmp_path / "out1").glob("store.tar.xz.*")] == ["store.tar.xz.00"]
    smol_scale.keep_store(tmp_path / "out1", tmp_path / "kept")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(OptionError, match="not an earlier output of experiments.smol_scale keep-store"):
        smol_scale.keep_store(tmp_path / "out1", tmp_path / "theirs")
    monkeypatch.setenv("OUT", str(tmp_path / "out3"))
    later = ["--quick", "--target", str(target), "--work", str(tmp_path / "work2")]
    assert smol_scale.main(["train", *later, "--store-parts", str(tmp_path / "kept"), "--init", str(out)]) == 0
    res3 = json.loads((tmp_path / "out3" / "results.json").read_text())
    assert res3["stages"]["unpack_store"]["result"] == {"parts": 1, "index": True}
    first = lambda r: r["stages"]["train"]["result"]["losses"][0][1]
    assert first(res3) < first(res)                  # it starts where the first run ended


def test_round_budget_charges_each_kernel_to_one_part():
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from experiments import budget

    assert budget.charge(["linears", "moe"]) == "moe" and budget.charge(["linears", "attention"]) == "linears"
    assert budget.charge([]) == "other" and budget.charge(["attention", "drafter"]) == "drafter"
    assert budget.busy_us([(0, 10), (5, 12), (20, 25)]) == 17

    def cpu(name, parent=None, kernels=()):
        return NS(name=name, cpu_parent=parent, kernels=[NS(duration=d) for d in kernels], device_type=DeviceType.CPU)

    moe = cpu("budget:moe")
    attn = cpu("budget:attention")
    lin = cpu("budget:linears", attn)
    events = [moe, cpu("launch", moe, [2000]), cpu("launch", cpu("budget:linears", moe), [1000]), attn,
              cpu("launch", lin, [500]), cpu("launch", attn, [300]), cpu("launch", None, [200])]
    events += [NS(device_type=DeviceType.CUDA, time_range=NS(start=s, end=e), kernels=[]) for s, e in
               ((0, 3000), (3000, 3800), (3800, 4000))]
    out = budget.split(NS(events=lambda: events), rounds=2, wall_ms=2.5)
    assert (out["moe"], out["linears"], out["attention"], out["other"]) == (1.5, 0.25, 0.15, 0.1)
    assert out["gpu_busy"] == 2.0 and out["host_gaps"] == 0.5 and out["charged_share"] == 1.0
