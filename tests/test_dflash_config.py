import json

import pytest

from toolkit.dflash import DFlashConfig
from toolkit.core.errors import ToolkitError

# The current upstream revision of z-lab/Qwen3.6-35B-A3B-DFlash, as documented (nested dflash_config).
CURRENT = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1e7, "sliding_window": 4096,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "block_size": 16,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37]},
}
# An older revision: 8 full-attention layers, taps [1,10,19,28,37], DFlash keys at the top level.
OLDER = {
    "architectures": ["DFlashDraftModel"], "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 8,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}, "block_size": 16, "mask_token_id": 248077,
    "target_layer_ids": [1, 10, 19, 28, 37],
}
TARGET = {"text_config": {"hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320}}


def test_current_layout():
    c = DFlashConfig.from_dict(CURRENT)
    assert (c.block_size, c.mask_token_id, c.tap_shift) == (16, 248077, 1)
    assert c.target_layer_ids == [1, 6, 11, 16, 22, 27, 32, 37]
    assert [c.window(i) for i in range(6)] == [4096] * 5 + [None]
    assert [c.block_causal(i) for i in range(6)] == [True] * 5 + [False]
    c.validate_against(TARGET)


def test_older_layout_top_level_keys():
    c = DFlashConfig.from_dict(OLDER)
    assert c.layer_types == ["full_attention"] * 8 and c.target_layer_ids == [1, 10, 19, 28, 37]
    assert c.rope_theta == 1e7 and c.block_causal(0) is False
    c.validate_against(TARGET)


def test_tap_shift_and_is_causal_overrides():
    c = DFlashConfig.from_dict({**CURRENT, "dflash_config": {**CURRENT["dflash_config"], "tap_shift": 0, "is_causal": False}})
    assert c.tap_shift == 0 and not any(c.block_causal(i) for i in range(6))


def test_round_trip_keeps_upstream_layout():
    c = DFlashConfig.from_dict(CURRENT)
    d = c.to_dict()
    assert d["dflash_config"]["target_layer_ids"] == CURRENT["dflash_config"]["target_layer_ids"]
    assert d["dflash_config"]["tap_shift"] == 1 and d["architectures"] == ["DFlashDraftModel"]
    assert DFlashConfig.from_dict(json.loads(json.dumps(d))) == c


@pytest.mark.parametrize("target, field, values", [
    ({"hidden_size": 4096, "num_hidden_layers": 40, "vocab_size": 248320}, "hidden_size", ("2048", "4096")),
    ({"hidden_size": 2048, "num_hidden_layers": 30, "vocab_size": 248320}, "target_layer_ids", ("32", "30")),
    ({"hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 151936}, "mask_token_id", ("248077", "151936")),
])
def test_validation_against_target(target, field, values):
    with pytest.raises(ToolkitError) as e:
        DFlashConfig.from_dict(CURRENT).validate_against(target)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field) and all(v in msg for v in values)


@pytest.mark.parametrize("patch, needle", [
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
    ({"dflash_config": {**CURRENT["dflash_config"], "block_size": 1}, "block_size": 1}, "block_size must be a whole number from 2 to 4096 tokens, got 1"),
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types has 5 entries, num_hidden_layers is 6"),
    ({"layer_types": ["sliding_attention"] * 5 + ["linear"]}, "unknown type 'linear'"),
    ({"num_key_value_heads": 5}, "not a multiple"),
    ({"dflash_config": {"block_size": 16, "mask_token_id": 1}}, "missing key 'target_layer_ids'"),
])
def test_bad_configs(patch, needle):
    with pytest.raises(ToolkitError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        DFlashConfig.from_dict({**CURRENT, **patch})


def test_missing_and_invalid_config_file(tmp_path):
    with pytest.raises(ToolkitError, match="no config.json"):
        DFlashConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ToolkitError, match="not valid JSON"):
        DFlashConfig.from_dir(tmp_path)
