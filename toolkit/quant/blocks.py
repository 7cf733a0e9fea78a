"""Drafter inputs from a target: per prompt, the target's taps and a few draft blocks (anchors) to run the drafter on.

At anchor a the drafter sees the taps of tokens 0..a-1 as context and the block [ids[a], MASK x (B-1)] at
positions a..a+B-1, exactly as in decoding right after token a was accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..dflash import DFlashConfig, DFlashDraft, gather_taps


@dataclass
class Prompt:
    """One prompt through the target: ids [n], the target's greedy next token per position, taps per tap_shift."""

    ids: torch.Tensor
    greedy: torch.Tensor
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    start: int = 1          # first anchor: the last prompt token when the target's own continuation follows


def load_target(path: Path, device: str = "cpu"):
    """A transformers target and its tokenizer; float32 unless it is large and on a GPU."""
    from ..runtime.hf import load_hf_model, load_hf_tokenizer

    tok = load_hf_tokenizer(path, "--target")
    model = load_hf_model(path, device, torch.float32 if device == "cpu" else torch.bfloat16, "--target")
    if device != "cpu" and sum(p.numel() for p in model.parameters()) < 2_000_000_000:
        model = model.float()
    return model, tok


def run_target(target, ids: list[int], config: DFlashConfig, shifts: list[int], continue_tokens: int = 0) -> Prompt:
    """Forward one prompt, extended by the target's own greedy continuation of `continue_tokens` tokens (where
    drafting happens in decoding); keep only the taps (for each tap_shift) and the greedy tokens."""
    x = torch.tensor([ids], dtype=torch.long, device=target.device)
    with torch.no_grad():
        if continue_tokens > 0:
            x = target.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=continue_tokens,
                                do_sample=False, pad_token_id=0)
        out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    taps = {s: gather_taps(hs, with_shift(config, s)).float() for s in shifts}
    return Prompt(x[0], out.logits[0].argmax(-1), taps, start=max(1, len(ids) - 1) if continue_tokens > 0 else 1)


def anchors(n: int, count: int, start: int = 1) -> list[int]:
    """Up to `count` anchor positions spread over start..n-1 (each needs at least one context token)."""
    start = max(1, start)
    if n - start < 1:
        return []
    count = max(1, min(count, n - start))
    step = (n - start) / count
    return sorted({start + int(i * step) for i in range(count)})


def with_shift(config: DFlashConfig, tap_shift: int) -> DFlashConfig:
    return dataclasses.replace(config, tap_shift=tap_shift)


def blocks(prompt: Prompt, drafter: DFlashDraft, embed_weight: torch.Tensor, count: int,
           tap_shift: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(anchor, noise_embeds [1,B,h], context taps [1,a,T*h], position_ids [1,a+B]) per anchor, on the drafter's
    device; the taps and the embedding table may live elsewhere (an EXL3 target's stay on the CPU)."""
    p = next(drafter.parameters())
    taps = prompt.taps[tap_shift].to(device=p.device, dtype=p.dtype)
    B = drafter.config.block_size
    for a in anchors(prompt.ids.numel(), count, prompt.start):
        noise = drafter.embed_block(prompt.ids[a : a + 1].to(embed_weight.device), embed_weight).to(p.device)
        pos = torch.arange(a + B, device=taps.device)[None]
        yield a, noise, taps[:, :a], pos


def draft_logits(drafter: DFlashDraft, lm_head, noise, ctx, pos) -> torch.Tensor:
    """Float32 logits [B-1, V] of the drafted positions 1..B-1 of one block."""
    with torch.no_grad():
        h = drafter(noise, ctx, pos)
        return lm_head(h[0, 1:].to(lm_head.weight.dtype)).float()
