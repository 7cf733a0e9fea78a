"""The DFlash training objective.

DFlash (Block Diffusion for Flash Speculative Decoding, arXiv:2602.06036, https://arxiv.org/abs/2602.06036)
trains the drafter on the target's own outputs: a block [x_a, MASK x (B-1)] anchored at position a sees the
target's tap features of positions < a only and predicts x_{a+1..a+B-1}; the cross-entropy of block position
k is weighted exp(-(k-1)/gamma), because an early miss ends the accepted prefix (gamma 7 for B=16, 5 for 10,
4 for 8: the values of the DFlash training recipe, as in SpecForge's OnlineDFlashModel loss_decay_gamma).
Several anchors per sequence share one context projection per step, as in that recipe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dflash import DFlashDraft


def position_weights(block: int) -> torch.Tensor:
    """DFlash loss weights over block positions k = 1..B-1: exp(-(k-1)/gamma), gamma 7 for B=16 (5 for 10, 4 for 8)."""
    gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block, max(block / 2.3, 1.0))
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def block_batch(seqs, taps, block: int, mask_id: int, batch: int, min_ctx: int = 8):
    """Random anchors p >= min_ctx: block ids [x_p, MASK...], labels x_{p+1..p+B-1}, context rows < p, positions.
    With min_ctx = prompt length - 1 every label is one of the target's own greedy tokens."""
    n, L = seqs.shape
    rows = torch.randint(0, n, (batch,))
    anchors = torch.randint(min_ctx, L - block + 1, (batch,))
    ar = torch.arange(block)
    labels = torch.stack([seqs[r, a + 1 : a + block] for r, a in zip(rows.tolist(), anchors.tolist())])
    ids = torch.full((batch, block), mask_id, dtype=torch.long)
    ids[:, 0] = seqs[rows, anchors]
    keep = torch.arange(L)[None] < anchors[:, None]
    pos = torch.cat([torch.arange(L)[None].expand(batch, -1), anchors[:, None] + ar[None]], 1)
    return ids, labels, taps[rows], keep, pos


def anchor_batch(ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, block: int, mask_id: int, anchors: int,
                 generator: torch.Generator) -> dict:
    """`anchors` random anchors per row of padded ids [S, L], in [start, length-2] (start = first response token;
    starts and lengths are CPU tensors, so no device sync). Returns block ids [S, A, B], labels [S, A, B-1],
    label validity (inside the row), the anchors and `ctx`, the context rows any block can see."""
    S, L = ids.shape
    span = (lengths - 1 - starts).clamp(min=1).to(torch.float32)
    u = torch.rand((S, anchors), generator=generator)
    a_cpu = starts[:, None] + (u * span[:, None]).long()                 # [S, A], uniform over the response
    a = a_cpu.to(ids.device)
    offs = torch.arange(block, device=ids.device)
    idx = a[..., None] + offs                                           # [S, A, B]
    valid = idx < lengths.to(ids.device)[:, None, None]
    tok = torch.gather(ids[:, None].expand(S, anchors, L), 2, idx.clamp(max=L - 1))
    blocks = torch.full_like(tok, mask_id)
    blocks[..., 0] = tok[..., 0]
    return {"blocks": blocks, "labels": tok[..., 1:], "valid": valid[..., 1:], "anchors": a, "ctx": int(a_cpu.max()) + 1}


def anchor_forward(model: DFlashDraft, embeds: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Drafter hidden states [S, A, B, h] for A blocks per row: the context is projected once per row and each
    block sees its row's context rows < its anchor (as at inference, where the anchor's own taps come later)."""
    S, A, B, h = embeds.shape
    n = taps.shape[1]
    ctx = model.context(taps)                                          # [S, n, h]
    ctx_pos = torch.arange(n, device=taps.device)[None].expand(S, n)
    keep = (torch.arange(n, device=taps.device)[None, None] < anchors[..., None]).reshape(S * A, n)
    pos = (anchors[..., None] + torch.arange(B, device=taps.device)).reshape(S * A, B)
    rep_pos = ctx_pos.repeat_interleave(A, 0)
    x = embeds.reshape(S * A, B, h)
    for layer in model.layers:
        k, v = layer.self_attn.project_kv(ctx, ctx_pos)
        x = layer(x, pos, k.repeat_interleave(A, 0), v.repeat_interleave(A, 0), rep_pos, keep)
    return model.norm(x).view(S, A, B, h)


def block_loss(model: DFlashDraft, batch: dict, taps: torch.Tensor, embed: torch.Tensor, head: torch.Tensor,
               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-weighted CE over valid labels, and top-1 accuracy per block position [B-1] (for the log).
    `embed`/`head` are the target's frozen embedding and lm_head weights."""
    embeds = F.embedding(batch["blocks"], embed).float() * model.config.input_embedding_scale   # fp32 residual under autocast
    hidden = anchor_forward(model, embeds, taps[:, : batch["ctx"]], batch["anchors"])[:, :, 1:]   # no block sees past its anchor
    logits = F.linear(hidden, head)
    labels, valid = batch["labels"], batch["valid"].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none").view(labels.shape)
    w = weights.to(ce.device) * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels).float() * valid
        acc = hit.sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)
    return loss, acc
