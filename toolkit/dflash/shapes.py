"""Config helpers for new DFlash drafters: evenly spread taps and an upstream-layout config dict.

Used by the trainer to shape a drafter for any target, and by the test fixtures to build tiny ones.
"""

from __future__ import annotations


def kv_heads(hidden: int) -> int:
    """4 heads of hidden/4; at widths that are multiples of 128 the K/V width is 128 too (exllamav3 pads to 128)."""
    return 4 if hidden % 128 == 0 else 2


def spread_taps(target_layers: int, n: int) -> list[int]:
    """n distinct tap ids spread over the target's layers (tap_shift 0), avoiding the last one (normed in HF)."""
    n = min(n, target_layers - 1)
    return sorted({round(i * (target_layers - 2) / max(n - 1, 1)) for i in range(n)})


def drafter_config(hidden: int, taps: list[int], mask_id: int, block_size: int, layers: int = 2, vocab_size: int | None = None,
                   window: int = 32, target_layers: int | None = None, intermediate: int | None = None) -> dict:
    """An upstream-layout DFlashDraftModel config: sliding layers then one full-attention layer."""
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": intermediate or 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": kv_heads(hidden),
        "head_dim": hidden // 4, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "hidden_act": "silu", "attention_bias": False,
        "layer_types": types, "sliding_window": window, "max_position_embeddings": 1024, "vocab_size": vocab_size,
        "num_target_layers": target_layers, "tie_word_embeddings": False, "block_size": block_size,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask_id, "target_layer_ids": taps, "tap_shift": 0},
    }
