"""experiments/ on CPU, so the device scripts do not rot between device runs: every module imports without
exllamav3 or CUDA, every script answers --help and is listed in experiments/README.md, none edits sys.path;
the shared harness (steps, errors, budget, partial results) and the Generator-loop timing against the
stand-in Generator of test_exl3_backend."""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import experiments
from experiments.exl3_timing import run_jobs
from experiments.harness import Run
from experiments.stream_shape import assert_stream_shape
from test_exl3_backend import ar_reference, fake_backend  # noqa: F401  (fake_backend is a fixture)
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "experiments"
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]))
LIBRARIES = {"harness", "exl3_timing", "perf_rig", "stream_shape", "ar_rounds", "lossless", "draft_exl3", "pair_mode"}      # imported by the scripts, not run
SCRIPTS = [m for m in MODULES if m not in LIBRARIES]


def test_the_package_holds_the_expected_modules():
    assert LIBRARIES <= set(MODULES)
    assert {"device_check", "perf_synth", "perf_report", "app_device", "quantize_device", "smol_device"} <= set(SCRIPTS)
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


def test_readme_lists_every_script():
    readme = (HERE / "README.md").read_text()
    for name in SCRIPTS:
        assert f"python -m experiments.{name}" in readme, f"experiments/README.md does not list {name}"


def test_modules_import_without_exllamav3_and_run_with_dash_m():
    code = ("import sys, importlib; [importlib.import_module('experiments.' + m) for m in sys.argv[1:]]; "
            "print('exllamav3' in sys.modules)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code, *MODULES], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
    run = subprocess.run([sys.executable, "-m", "experiments.smol_tables", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and "usage: python -m experiments.smol_tables" in run.stdout, run.stderr[-2000:]


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


PROMPTS = [[1, 2, 3], [4, 9], [20, 21, 22, 23], [30]]


def test_plain_loop_emits_the_ar_tokens(fake_backend):  # noqa: F811
    loop = run_jobs(fake_backend, PROMPTS, GenSettings(max_new_tokens=40, block_size=6), hooked=False)
    assert loop.tokens == [ar_reference(p, 40) for p in PROMPTS]
    assert loop.rounds == [] and loop.iterations == len(loop.iterate_s) == len(loop.post_s) > 1
    assert loop.seconds >= sum(loop.iterate_s) > 0


def test_hooked_loop_with_rounds_is_generate_many(fake_backend):  # noqa: F811
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


def test_max_steps_stops_early_and_frees_the_jobs(fake_backend):  # noqa: F811
    loop = run_jobs(fake_backend, PROMPTS, GenSettings(max_new_tokens=40, block_size=6), max_steps=3)
    assert loop.iterations == 3 and len(loop.iterate_s) == 3
    assert fake_backend._gen.num_remaining_jobs() == 0
    assert all(0 < len(t) < 40 for t in loop.tokens)


def test_capture_errors_raise_or_are_recorded(fake_backend, monkeypatch):  # noqa: F811
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
