"""Fixtures: every architecture builds offline in seconds; the tiny-pair builder is deterministic."""

import json

from toolkit.dflash import DFlashConfig, load_drafter
from toolkit.assets.fixtures import ARCHS, spread_taps
from toolkit.train.tiny import build_pair, position_weights


def test_every_arch_builds_in_upstream_layout(models):
    for arch in ARCHS:
        target, draft = models[arch]
        cfg = json.loads((draft / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg
        assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
        DFlashConfig.from_dir(draft).validate_against(json.loads((target / "config.json").read_text()))
        names = set(load_drafter(draft).state_dict())
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
                "layers.1.mlp.down_proj.weight"} <= names
    moe = json.loads((models["qwen3_5_moe"][0] / "config.json").read_text())
    assert "linear_attention" in moe["layer_types"] and moe["num_experts"] > 1


def test_taps_spread_and_loss_weights():
    assert spread_taps(4, 3) == [0, 1, 2] and spread_taps(30, 5) == [0, 7, 14, 21, 28]
    w = position_weights(16)
    assert len(w) == 15 and w[0] == 1 and (w[1:] < w[:-1]).all()


def test_tiny_pair_build_is_deterministic(tmp_path):
    a = build_pair(str(tmp_path / "a"), seed=3, target_steps=4, draft_steps=3, sequences=4)
    b = build_pair(str(tmp_path / "b"), seed=3, target_steps=4, draft_steps=3, sequences=4)
    for sub in ("target", "draft"):
        fa = (a / sub / "model.safetensors").read_bytes()
        assert fa == (b / sub / "model.safetensors").read_bytes()
    assert (a / "target" / "tokenizer.json").read_text() == (b / "target" / "tokenizer.json").read_text()
    assert sum(f.stat().st_size for f in (tmp_path / "a").rglob("*") if f.is_file()) < 2 * 1024 * 1024
    assert not list(tmp_path.glob(".tiny_pair.*"))
