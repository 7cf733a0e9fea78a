"""The target side of a quantize run: each prompt as the target sees it (ids, greedy tokens, taps per tap_shift),
and the two pieces of the target the drafter borrows (the embedding table and the LM head).

Two kinds of target behind the same Prompt objects. A transformers (BF16) target stays loaded and is itself
what calibration and the check read (blocks.run_target). An EXL3 target runs on exllamav3 (engine.ENGINE) only
while the prompts are made, in one load: the greedy continuation of every prompt, one forward per prompt that
exports the tap layers, the embedding table (kept on the CPU) and the LM head (dequantized); it is then
unloaded and `Parts` stands in for it, so the same calibration and KL/top-1 code runs on both paths.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ..core.target import TargetInfo
from ..dflash import DFlashConfig
from . import memory as mem
from .blocks import Prompt, run_target


class Head(nn.Module):
    """An LM head from its weight [vocab, hidden] (no bias)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Parts(nn.Module):
    """The EXL3 target's embedding table and LM head, with the two accessors calibrate/compare call on a target.
    The table stays on the CPU (as exllamav3 keeps it); the head moves to the check's device."""

    def __init__(self, table: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(table, freeze=True)
        self.head = Head(head)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> Head:
        return self.head

    def head_to(self, device: str) -> "Parts":
        self.head.to(device)
        return self


def tap_layers(config: DFlashConfig, shifts: list[int]) -> list[int]:
    """Target layers whose outputs the taps read: L + s for every tap L and shift s."""
    return sorted({L + s for L in config.target_layer_ids for s in shifts})


def fitting_shifts(candidates: list[int], config: DFlashConfig, target_cfg: dict | None) -> list[int]:
    """The candidate tap_shifts that name target layers (tap L + shift must be a layer of the target)."""
    layers = TargetInfo(target_cfg or {}).num_layers or 1 << 30
    return [x for x in candidates if all(0 <= t + x < layers for t in config.target_layer_ids)]


def target_shifts(candidates: list[int], config: DFlashConfig, target_cfg: dict | None) -> list[int]:
    """The tap_shifts the target step exports: the fitting candidates and the drafter's own."""
    return sorted(set(fitting_shifts(candidates, config, target_cfg)) | {config.tap_shift})


def exl3_opener(open_target: Callable[..., object], folder, prompt_ids: list[list[int]], max_new_tokens: int,
                **split_kw) -> Callable[[], object]:
    """`open_target` (engine.ENGINE's) sized for these prompts: mem.BATCH of them at a time with their
    continuations in the cache; exllamav3 loads measuring a forward of max_chunk tokens, so that is the longest
    forward the target step runs rather than exllamav3's default 2048."""
    n = max(map(len, prompt_ids))
    batch = min(mem.BATCH, max(1, len(prompt_ids)))
    tokens = batch * mem.job_tokens(n, max_new_tokens, 1)
    return lambda: open_target(folder, tokens, batch, max_chunk=mem.pages(n + max_new_tokens), **split_kw)


def continued(target, prompt_ids: list[list[int]], continue_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (as it is without one)."""
    return target.continue_greedy(prompt_ids, continue_tokens) if continue_tokens > 0 else [list(p) for p in prompt_ids]


def exl3_prompts(target, prompt_ids: list[list[int]], config: DFlashConfig, shifts: list[int],
                 continue_tokens: int = 0, full: list[list[int]] | None = None) -> list[Prompt]:
    """Prompts through an EXL3 target (runtime.exl3_taps.Exl3Target): each extended by the target's greedy
    continuation (`full`, when already made), then one forward for the greedy tokens and the taps (output of layer
    L + s per tap L)."""
    full = full if full is not None else continued(target, prompt_ids, continue_tokens)
    layers = tap_layers(config, shifts)
    out = []
    for ids0, ids in zip(prompt_ids, full):
        greedy, states = target.forward(ids, layers)
        taps = {s: torch.cat([states[L + s] for L in config.target_layer_ids], dim=-1) for s in shifts}
        start = max(1, len(ids0) - 1) if continue_tokens > 0 else 1
        out.append(Prompt(torch.tensor(ids, dtype=torch.long), greedy, taps, start=start))
    return out


def exl3_target(open_target: Callable[[], object], cal_ids: list[list[int]], held_ids: list[list[int]],
                config: DFlashConfig, shifts: list[int], continue_tokens: int,
                phase: Callable[[str], AbstractContextManager]) -> tuple[list[Prompt], list[Prompt], Parts]:
    """The calibration and check prompts and the Parts from an EXL3 target loaded for this alone, unloaded at the
    end; `phase(name)` measures each phase: load, continue (greedy continuations), forward (the taps), parts."""
    with phase("load"):
        t = open_target()
    try:
        with phase("continue"):
            full = [continued(t, ids, continue_tokens) for ids in (cal_ids, held_ids)]
        with phase("forward"):
            cal = exl3_prompts(t, cal_ids, config, [config.tap_shift], continue_tokens, full[0])
            held = exl3_prompts(t, held_ids, config, shifts, continue_tokens, full[1])
        with phase("parts"):
            parts = exl3_parts(t)
    finally:
        t.close()
    return cal, held, parts


def hf_prompts(model, prompt_ids: list[list[int]], config: DFlashConfig, shifts: list[int],
               continue_tokens: int = 0) -> list[Prompt]:
    """The same through a loaded transformers target."""
    return [run_target(model, ids, config, shifts, continue_tokens) for ids in prompt_ids]


def exl3_parts(target) -> Parts:
    """Embedding table and dequantized LM head of a loaded EXL3 target, copied to the CPU."""
    return Parts(target.embedding_table(), target.head_weight())


def target_bits(cfg: dict | None) -> float | None:
    """An EXL3 target's bitrate, from its quantization_config."""
    bits = ((cfg or {}).get("quantization_config") or {}).get("bits")
    return float(bits) if bits is not None else None
