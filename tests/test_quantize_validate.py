"""Steps 1-2 on CPU: recipe and bits parsing, checkpoint validation (every bad input), plan and dry run."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures_upstream import write_upstream_drafter, write_upstream_target
from toolkit.dflash import save_drafter
from toolkit.core.errors import ToolkitError
from toolkit.assets.fixtures import drafter_config, random_drafter
from toolkit.quantize import main
from toolkit.quant.plan import expected_size, make_plan
from toolkit.quant.recipe import branch_name, load_recipe, parse_bits
from toolkit.quant.validate import read_header, validate

RECIPE = "quantize/qwen3.6-35b-a3b-dflash.toml"


def one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture
def drafter(tmp_path):
    m = random_drafter(drafter_config(16, [0, 1, 2], 5, 4, vocab_size=64, window=8, target_layers=4))
    return save_drafter(m, tmp_path / "draft", dtype=torch.float32)


def target_cfg(**kw):
    return {"hidden_size": 16, "num_hidden_layers": 4, "vocab_size": 64, **kw}


def test_shipped_recipe():
    r = load_recipe(RECIPE)
    assert r.model == "z-lab/Qwen3.6-35B-A3B-DFlash" and r.target == "Qwen/Qwen3.6-35B-A3B"
    # no sha of the current revision could be read offline: "main", guarded by [model.expect]
    assert r.revision == "main" and r.expect["num_hidden_layers"] == 6
    assert r.expect["target_layer_ids"] == [1, 6, 11, 16, 22, 27, 32, 37]
    assert r.bits == [3.0, 4.0, 5.0, 6.0, 8.0]
    assert not set(r.calibration_prompts) & set(r.check_prompts) and r.check_prompts
    assert r.thresholds_for(8.0).min_top1 == 0.99 and r.thresholds_for(4.0).min_top1 == 0.80


@pytest.mark.parametrize("spec,msg", [("0.5", "outside exllamav3's range"), ("9", "outside"), ("4,abc", "not a number"),
                                      ("4.123", "not representable"), ("4,4.0", "twice"), ("4,,5", "empty"),
                                      ("nan", "outside")])
def test_bad_bits(spec, msg):
    with pytest.raises(ToolkitError) as e:
        parse_bits(spec)
    assert msg in one_line(e)


def test_bits_and_branches():
    assert parse_bits("8,3.0,4.25") == [3.0, 4.25, 8.0]
    assert [branch_name(b) for b in (2, 4.0, 4.25, 8)] == ["2.0bpw", "4.0bpw", "4.25bpw", "8.0bpw"]


def test_valid_checkpoint(drafter):
    c = validate(drafter, target_cfg())
    assert c.has_weights and "fc.weight" in c.tensors and c.size_bytes > 0


def test_wrong_architecture(drafter):
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ToolkitError) as e:
        validate(drafter)
    assert "expected ['DFlashDraftModel']" in one_line(e)


def test_remote_code_only_checkpoint_refused(drafter):
    cfg = json.loads((drafter / "config.json").read_text())
    cfg.update(architectures=["EagleDraftModel"], auto_map={"AutoModel": "eagle.EagleDraftModel"})
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ToolkitError) as e:
        validate(drafter)
    assert "trust_remote_code" in one_line(e)


def test_missing_and_misshaped_tensor(drafter):
    sd = load_file(drafter / "model.safetensors")
    sd.pop("layers.1.self_attn.k_proj.weight")
    save_file(sd, drafter / "model.safetensors")
    with pytest.raises(ToolkitError) as e:
        validate(drafter)
    assert "missing tensor 'layers.1.self_attn.k_proj.weight'" in one_line(e)
    sd["layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 16)
    save_file(sd, drafter / "model.safetensors")
    with pytest.raises(ToolkitError) as e:
        validate(drafter)
    assert "has shape [3, 16], expected [8, 16]" in one_line(e)


def test_truncated_safetensors(drafter):
    f = drafter / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ToolkitError) as e:
        validate(drafter)
    assert "truncated" in one_line(e)
    f.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ToolkitError, match="truncated"):
        read_header(f)


@pytest.mark.parametrize("cfg,msg", [(target_cfg(num_hidden_layers=2), "outside the target's 2 layers"),
                                     (target_cfg(vocab_size=32), "vocab_size: drafter has 64, target has 32"),
                                     (target_cfg(hidden_size=32), "hidden_size: drafter has 16, target has 32")])
def test_mismatch_with_target(drafter, cfg, msg):
    with pytest.raises(ToolkitError) as e:
        validate(drafter, cfg)
    assert msg in one_line(e)


def test_plan_status_and_size(tmp_path, drafter):
    config = validate(drafter).config
    assert expected_size(config, 8.0) > expected_size(config, 4.0) > 0
    items = make_plan(config, [4.0], tmp_path, "m", None, calibrate=True, also_uncalibrated=True)
    assert [(i.folder, i.calibrated, i.pushed, i.status) for i in items] == [
        ("4.0bpw", True, True, "todo"), ("4.0bpw-uncal", False, False, "todo")]
    (tmp_path / ".4.0bpw.partial").mkdir()
    assert make_plan(config, [4.0], tmp_path, "m", None, True)[0].status == "partial"


def test_dry_run_with_upstream_config(tmp_path, capsys):
    """The issue's done-when: the recipe plus a local folder holding only the upstream config.json."""
    folder = write_upstream_drafter(tmp_path / "Qwen3.6-35B-A3B-DFlash", shape="issue")
    assert main(["--recipe", RECIPE, "--model", str(folder), "--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    for b in ("3.0bpw", "4.0bpw", "5.0bpw", "6.0bpw", "8.0bpw"):
        assert b in out
    assert "6 layers, hidden 2048" in out and "taps [1, 6, 11, 16, 22, 27, 32, 37]" in out
    assert not (tmp_path / "o").exists()


def test_dry_run_issue_shape_against_target(tmp_path, capsys):
    d = write_upstream_drafter(tmp_path / "d", shape="issue")
    t = write_upstream_target(tmp_path / "t")
    assert main(["--recipe", RECIPE, "--model", str(d), "--target", str(t), "--dry-run", "--bits", "2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "6 layers" in out and "sliding_attention" in out and "not checked" not in out.split("note: no weights")[0]
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 10, 45]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ToolkitError) as e:
        main(["--model", str(d), "--target", str(t), "--dry-run"])
    assert "tap 45" in one_line(e)


def test_offline_hub_id_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ToolkitError) as e:
        main(["--model", "z-lab/not-cached-DFlash", "--out", str(tmp_path / "o"), "--no-check", "--no-calibrate"])
    msg = one_line(e)
    assert "offline" in msg and "local folder" in msg


def test_cli_help_explains(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--recipe", "--bits", "--dry-run", "--force", "--push", "--no-calibrate", "--no-check", "--work-dir"):
        assert flag in text


def test_recipe_refuses_the_older_revision(tmp_path, capsys):
    """The shipped recipe expects the current 6-layer revision; the older 8-full-layer config is refused in one line."""
    import json as _json
    from pathlib import Path as _Path

    from test_dflash_config import CURRENT, OLDER
    from toolkit.quantize import main as _main

    recipe = _Path(__file__).resolve().parents[1] / "quantize" / "qwen3.6-35b-a3b-dflash.toml"
    for name, cfg in (("current", CURRENT), ("older", OLDER)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(_json.dumps(cfg))
    _main(["--recipe", str(recipe), "--model", str(tmp_path / "current"), "--out", str(tmp_path / "o1"), "--dry-run"])
    with pytest.raises(ToolkitError) as e:
        _main(["--recipe", str(recipe), "--model", str(tmp_path / "older"), "--out", str(tmp_path / "o2"), "--dry-run"])
    err = one_line(e)
    assert "num_hidden_layers is 8" in err and "expects 6" in err
    assert not (tmp_path / "o2").exists()


def test_shipped_smollm2_recipe_checks_on_held_out_prompts():
    held = json.loads(open("toolkit/data/smollm2_dflash/heldout.json").read())
    r = load_recipe("quantize/smollm2-135m-dflash.toml")
    assert r.model == "toolkit/data/smollm2_dflash" and r.bits == [2.0, 3.0, 4.0, 5.0, 6.0, 8.0]
    # check prompts: the first 6 of each held-out category; calibration prompts: training prompts, none held out
    assert r.check_prompts == held["chat"][:6] + held["code"][:6]
    assert r.calibration_prompts and not set(r.calibration_prompts) & set(held["chat"] + held["code"])
    assert r.thresholds_for(4.0).min_tau_ratio == 0.97 and r.thresholds_for(5.0).min_top1 == 0.80
