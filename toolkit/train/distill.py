"""The target's side of self-distillation: its tap features for a batch of its own sequences, computed when needed.

At 100k answers the features of every sequence (prompt + answer, 5 taps x 576 wide) would be hundreds of GB, so
the trainer runs the frozen target on each step's sequences instead (a forward of a 135M model is a small share of
a step that drafts hundreds of blocks per sequence).
"""

from __future__ import annotations

import inspect

import torch

from ..dflash import DFlashConfig, gather_taps


@torch.no_grad()                   # not inference_mode: the drafter's backward saves these as inputs
def target_taps(model, ids: torch.Tensor, lengths: torch.Tensor, config: DFlashConfig) -> torch.Tensor:
    """The target's hidden states at the drafter's taps for right-padded ids [S, L]: [S, L, taps*hidden] in the
    target's dtype, on its device (padding rows come after each sequence, so they change nothing before it)."""
    params = inspect.signature(model.forward).parameters
    kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).to(ids.device)
    out = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, use_cache=False, **kw)
    return gather_taps(out.hidden_states, config)
