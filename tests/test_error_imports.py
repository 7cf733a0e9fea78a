"""Bad input is refused before the heavy libraries load: a wrong flag, path, folder or file is one `error:` line in
a fraction of a second, not after the 1.5-2.5 s of importing torch (and transformers).

Checked as tests/test_help_imports.py checks --help: by what a run imports (`python -X importtime`, the modules a
process imports), not by a wall clock. Each case is a bad command line built in tmp_path; a check that needs a heavy
library itself (whether this machine has a CUDA GPU) is not among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_help_imports import HEAVY

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
T, D = str(PAIR / "target"), str(PAIR / "draft")
SHAPE = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
         "text_config": {"hidden_size": 128}}

# (id, argv after `python -m toolkit.`, words of the error line); {names} are paths made in tmp_path by `inputs`
CASES = [
    ("fixtures-out-foreign", ["fixtures", "--out", "{foreign}"], "is not an earlier output of fixtures"),
    ("quantize-out-file", ["quantize", "--model", D, "--bits", "4", "--out", "{afile}"], "exists and is not a folder"),
    ("quantize-bits-nine", ["quantize", "--model", D, "--bits", "9", "--out", "{new}"], "outside exllamav3's range"),
    ("quantize-recipe-types", ["quantize", "--recipe", "{bad_toml}", "--out", "{new}"], "model.id must be a string"),
    ("eval_tau-block-sizes", ["eval_tau", "--target", T, "--draft", D, "--block-sizes", "8", "x"],
     "--block-sizes must be integers >= 2"),
    ("eval_tau-heldout-empty", ["eval_tau", "--target", T, "--draft", D, "--heldout", "{empty}"], "is not valid JSON"),
    ("generate-drafter-as-target", ["generate", "--target", D, "--prompt", "hi"], "is a DFlash drafter, not a target"),
    ("generate-target-missing", ["generate", "--target", "{missing}", "--prompt", "hi"], "is not a folder"),
    ("bench-target-as-draft", ["bench", "--target", T, "--draft", T, "--out", "{new}"], "not a DFlash drafter"),
    ("train_drafter-out-foreign", ["train_drafter", "--target", T, "--out", "{foreign}"],
     "is not an earlier output of train_drafter"),
    ("train_drafter-target-missing", ["train_drafter", "--target", "{missing}", "--out", "{new}"], "has no config.json"),
    ("synth-config-list", ["synth", "--config", "{list_json}", "--bits", "4", "--out", "{new}"], "expected a JSON object"),
    ("synth-head-bits", ["synth", "--config", "{shape}", "--bits", "4", "--out", "{new}", "--head-bits", "12"],
     "--head-bits must be an integer"),
    ("space-exllamav3-on-cpu", ["space", "export", "{new}", "--hardware", "cpu-basic", "--backend", "exllamav3"],
     "needs GPU hardware"),
    ("preview_run-out-file", ["preview_run", "--out", "{afile}"], "exists and is not a folder"),
]


def run_imports(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The run of `python -X importtime ARGS` (from the repository root) and the top-level packages it imported."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    rows = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert len(rows) > 20, r.stderr[-500:]                  # -X importtime did report (the header row included)
    return r, {name.split(".")[0] for name in rows}


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    """stderr without importtime's rows."""
    return [line for line in r.stderr.splitlines() if not line.startswith("import time:")]


@pytest.fixture
def inputs(tmp_path) -> dict[str, str]:
    paths = {name: tmp_path / file for name, file in (
        ("foreign", "foreign"), ("afile", "afile"), ("empty", "empty.json"), ("list_json", "list.json"),
        ("bad_toml", "bad.toml"), ("shape", "shape.json"), ("missing", "nothing"), ("new", "new"))}
    paths["foreign"].mkdir()
    (paths["foreign"] / "notes.txt").write_text("mine, not the command's")
    paths["afile"].write_text("a file where a folder is asked for")
    paths["empty"].write_text("")
    paths["list_json"].write_text("[1]")
    paths["bad_toml"].write_text("[model]\nid = 3\n")
    paths["shape"].write_text(json.dumps(SHAPE))
    return {name: str(p) for name, p in paths.items()}


@pytest.mark.parametrize("args,msg", [(a, m) for _, a, m in CASES], ids=[i for i, _, _ in CASES])
def test_bad_input_is_refused_before_the_heavy_libraries(inputs, args, msg):
    argv = [a.format(**inputs) for a in args]
    r, mods = run_imports(["-m", f"toolkit.{argv[0]}", *argv[1:]])
    lines = error_lines(r)
    cmdline = f"python -m toolkit.{' '.join(argv)}"
    assert r.returncode == 2 and "Traceback" not in r.stderr, f"{cmdline}: exit {r.returncode}\n{lines[-5:]}"
    assert [x for x in lines if x.startswith("error:")] == lines[-1:] and msg in lines[-1], f"{cmdline}: {lines[-3:]}"
    heavy = mods & HEAVY
    assert not heavy, f"{cmdline} imports {sorted(heavy)} before refusing: check first, import where the work starts"
    assert not Path(inputs["new"]).exists()


def test_the_check_sees_a_heavy_import(tmp_path):
    """The check itself: a script that imports a heavy library before it refuses its input is caught."""
    script = tmp_path / "heavy.py"
    script.write_text("import sys\nimport numpy\nprint('error: bad input', file=sys.stderr)\nsys.exit(2)\n")
    r, mods = run_imports([str(script)])
    assert r.returncode == 2 and error_lines(r) == ["error: bad input"]
    assert "numpy" in mods & HEAVY
