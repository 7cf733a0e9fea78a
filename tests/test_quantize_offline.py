"""The recipe's dry run plans offline: from the recipe's shapes when the Hub models are not in the local cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
RECIPE = "quantize/qwen3.6-35b-a3b-dflash.toml"


def dry_run(tmp_path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "toolkit.quantize", "--recipe", RECIPE, "--dry-run",
                           "--out", str(tmp_path / "out"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_recipe_dry_run_plans_offline_and_says_what_a_run_downloads(tmp_path):
    r = dry_run(tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "planned from the recipe's shapes (shapes/qwen3.6-35b-a3b-dflash.json" in out
    assert "(the recipe's shapes)" in out.splitlines()[0] and "dflash-shapes-" not in out    # no temp path shown
    assert "4.0bpw" in out and "memory plan" in out
    assert re.search(r"z-lab/Qwen3\.6-35B-A3B-DFlash@main: the drafter's weights, about \d+\.\d GiB", out)
    assert re.search(r"Qwen/Qwen3\.6-35B-A3B: the target, BF16 \(transformers\), about \d+\.\d GiB", out)
    assert re.search(r"one 24 GB GPU pass an EXL3 quant of it as --target instead: at 4\.0 bpw about \d+\.\d GiB", out)
    assert "does not fit a 24 GB card" in out                    # the BF16 target's weights are in the plan now
    assert not (tmp_path / "out").exists()                       # a dry run writes nothing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("dflash-shapes-")]   # its temp config removed


def test_a_local_target_without_weights_downloads_only_the_drafter_and_is_planned_from_its_config(tmp_path):
    import json

    target = tmp_path / "t"
    target.mkdir()
    cfg = json.loads((ROOT / "quantize/shapes/qwen3.6-35b-a3b.json").read_text())
    (target / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if not k.startswith("_")}))
    r = dry_run(tmp_path, "--target", str(target))
    assert r.returncode == 0, r.stderr
    assert "the drafter's weights" in r.stdout and "the target," not in r.stdout
    assert "note: the target's folder holds no weights: they are planned from its config.json, about 6" in r.stdout
    assert "does not fit a 24 GB card" in r.stdout and re.search(r"target weights 6\d\.\d GiB", r.stdout)


def test_without_shapes_a_missing_model_is_still_one_error_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "toolkit.quantize", "--model", "nobody/Nothing-DFlash", "--dry-run"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --model: nobody/Nothing-DFlash")


def test_a_plan_without_the_targets_weights_never_says_it_fits():
    from toolkit.quant import memory as mem
    from toolkit.quant.offline import config_weights

    assert config_weights({"model_type": "nothing-known"}, "hf") is None
    text = mem.format_memory([mem.Need("target", {"target weights": 0})], weights_known=False)
    assert "fits" not in text.replace("whether it fits", "") and "whether it fits a 24 GB card is not known" in text
    assert " fits a 24 GB card" in mem.format_memory([mem.Need("target", {"target weights": 0})])
