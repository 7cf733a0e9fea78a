"""config.json files in the exact upstream layouts (z-lab DFlash drafter, Qwen3.6-35B-A3B target), no weights.

"pinned" is what public sources report for z-lab/Qwen3.6-35B-A3B-DFlash at the recipe's revision (8 full-attention
layers); "issue" is the shape issue 3 describes (6 layers: 5 sliding-window + 1 full).
"""

from __future__ import annotations

import json
from pathlib import Path

TAPS_40 = [1, 10, 19, 28, 37]
TAPS_CURRENT = [1, 6, 11, 16, 22, 27, 32, 37]


def upstream_drafter_config(shape: str = "pinned") -> dict:
    if shape == "pinned":      # the older revision: 8 full-attention layers, 5 taps
        layers, types, window, taps, mask, kv = 8, ["full_attention"] * 8, None, TAPS_40, 248070, 4
    elif shape == "issue":     # the current revision (DEVELOPERS.md facts)
        layers, types, window, taps, mask, kv = 6, ["sliding_attention"] * 5 + ["full_attention"], 4096, TAPS_CURRENT, 248077, 8
    else:
        raise ValueError(shape)
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(taps)},
        "dtype": "bfloat16",
        "eos_token_id": 248046,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "layer_types": types,
        "max_position_embeddings": 262144,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "num_target_layers": 40,
        "pad_token_id": 248044,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "sliding_window": window,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": window is not None,
        "vocab_size": 248320,
    }


def upstream_target_config() -> dict:
    """The text part of Qwen/Qwen3.6-35B-A3B's config (multimodal layout: text_config)."""
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "layer_types": types,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
        },
    }


def write_config(folder: str | Path, cfg: dict) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def write_upstream_drafter(folder: str | Path, shape: str = "pinned") -> Path:
    return write_config(folder, upstream_drafter_config(shape))


def write_upstream_target(folder: str | Path) -> Path:
    return write_config(folder, upstream_target_config())
