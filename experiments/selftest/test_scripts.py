"""experiments/ on the CPU, so the device scripts do not rot between device runs: every module imports without
exllamav3 or CUDA, every script answers --help and is listed in experiments/README.md, none edits sys.path; and the
shared harness (Run, Repetitions). Each script's own logic on stand-ins is checked in test_timing.py (the timing
scripts) and test_models.py (the scripts that convert, quantize and train)."""

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
from experiments.harness import Run

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "experiments"
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if not m.ispkg)     # the selftest package aside
LIBRARIES = {"harness", "exl3_loop", "pair_mode", "budget", "moe_decode"}     # imported by the scripts, not run
SCRIPTS = [m for m in MODULES if m not in LIBRARIES]


def test_the_package_holds_the_expected_modules():
    assert LIBRARIES <= set(MODULES)
    assert {"device_check", "speed", "draft_step", "app_device", "quantize_device", "quantize_exl3", "smol_device",
            "smol_scale", "two_gpu", "auto_cpu", "round_trace", "policy_replay"} <= set(SCRIPTS)
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


def test_auto_cpu_app_takes_one_mode_and_no_cold_or_poison(capsys):
    from experiments import auto_cpu

    for argv in (["--app", "--modes", "auto,fixed16"], ["--app", "--cold"], ["--app", "--poison", "0.2"]):
        with pytest.raises(SystemExit) as e:
            auto_cpu.main(argv)
        assert e.value.code == 2 and "--app takes one mode" in capsys.readouterr().err
