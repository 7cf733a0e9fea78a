"""The DFlash training objective, at the published recipe's scale.

Where each choice comes from:
- The objective (DFlash, Block Diffusion for Flash Speculative Decoding, arXiv:2602.06036,
  https://arxiv.org/abs/2602.06036): a block [x_a, MASK x (B-1)] anchored at position a sees the target's tap
  features of positions < a only and predicts x_{a+1..a+B-1}; the cross-entropy of block position k is weighted
  w_k = exp(-(k-1)/gamma) (the paper's Eq. 4, as SpecForge and NeMo AutoModel cite it), because an early miss ends
  the accepted prefix.
- The target's own answers, regenerated rather than the dataset's: SpecForge ships scripts/regenerate_train_data.py
  for it, and NVIDIA NeMo AutoModel's DFlash recipes (nemo_automodel.recipes.llm.train_dflash2, docs.nvidia.com)
  say to regenerate the responses with the target first, as the mismatch otherwise hurts acceptance length.
- gamma 7 for B=16, 5 for B=10, 4 for B=8: the values SpecForge's DFlash recipe suggests for the paper's Eq. 4
  (sgl-project/SpecForge, scripts/train_dflash.py, --loss-decay-gamma: "Suggested: 7 for block_size=16, 5 for 10,
  4 for 8"; its specforge/core/dflash.py OnlineDFlashModel applies exp(-(k-1)/gamma)).
- About 512 anchors per sequence: SpecForge's --num-anchors default (512), drawn afresh at every forward, without
  replacement, among the loss-masked positions up to length - B (OnlineDFlashModel._sample_anchor_positions); a
  sequence with fewer such positions uses them all. Here they are drawn from the answer positions with at least one
  answer token after them (a block running past the end has its missing labels masked, as decoding near the end
  drafts such blocks), so every label is one of the target's own greedy tokens.
- One shared context per sequence: all of a sequence's blocks attend to its tap rows (each to those before its
  anchor) and to their own block only, as in SpecForge's DFlash attention mask; the in-block pattern is the drafter's
  own (sliding layers causal in the block, full layers bidirectional, as at inference in toolkit/dflash/model.py).
z-lab's repository (z-lab/dflash, README) says its training recipe is not published yet, so nothing here is from it.

Memory: a step's anchors are processed in chunks of `chunk` anchors per sequence, each chunk's loss back-propagated
at once (gradient accumulation). The loss is normalised by the weight of the whole step before any chunk runs, so the
gradient is the one of the unchunked loss (tests/test_train_scale.py checks it).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from ..dflash import DFlashDraft
from ..dflash.model import rope

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def position_weights(block: int) -> torch.Tensor:
    """DFlash loss weights over block positions k = 1..B-1: exp(-(k-1)/gamma), gamma 7 for B=16 (5 for 10, 4 for 8)."""
    gamma = GAMMA.get(block, max(block / 2.3, 1.0))
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def block_batch(seqs, taps, block: int, mask_id: int, batch: int, min_ctx: int = 8):
    """Random anchors p >= min_ctx: block ids [x_p, MASK...], labels x_{p+1..p+B-1}, context rows < p, positions.
    With min_ctx = prompt length - 1 every label is one of the target's own greedy tokens (the tiny pair's builder)."""
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


def sample_anchors(starts: torch.Tensor, lengths: torch.Tensor, count: int | None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [S, A] and their validity: per row, `count` distinct positions drawn uniformly from [start, length-2]
    (the answer positions with a token after them), in increasing order; all of them when the row has fewer, or when
    count is None (no randomness then). CPU tensors; A is the largest count of any row, invalid slots hold `start`."""
    span = (lengths - 1 - starts).clamp(min=0)
    W = int(span.max()) if len(span) else 0
    k = span if count is None else span.clamp(max=count)
    A = int(k.max()) if len(k) else 0
    if A == 0:
        return torch.zeros((len(span), 0), dtype=torch.long), torch.zeros((len(span), 0), dtype=torch.bool)
    inside = torch.arange(W)[None] < span[:, None]
    if count is None or count >= W:
        offs = torch.arange(W)[None].expand(len(span), -1)
    else:
        r = torch.rand((len(span), W), generator=generator).masked_fill(~inside, 2.0)
        offs = r.argsort(1)                            # a random order of the valid offsets, invalid ones last
    valid = torch.arange(A)[None] < k[:, None]
    offs = torch.where(valid, offs[:, :A], W).sort(1).values
    return torch.where(valid, starts[:, None] + offs, starts[:, None]), valid


def make_blocks(ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, block: int,
                mask_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block ids [S, A, B] = [x_a, MASK...], labels [S, A, B-1] = x_{a+1..a+B-1}, label validity (inside the row,
    valid anchor); all on ids' device."""
    S, L = ids.shape
    idx = anchors[..., None] + torch.arange(block, device=ids.device)
    ok = (idx < lengths.to(ids.device)[:, None, None]) & valid[..., None]
    tok = torch.gather(ids[:, None].expand(S, anchors.shape[1], L), 2, idx.clamp(max=L - 1))
    blocks = torch.full_like(tok, mask_id)
    blocks[..., 0] = tok[..., 0]
    return blocks, tok[..., 1:], ok[..., 1:]


def anchor_batch(ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, block: int, mask_id: int, anchors: int,
                 generator: torch.Generator) -> dict:
    """`anchors` random distinct anchors per row of padded ids [S, L] (CPU starts/lengths): block ids, labels, label
    validity, the anchors and `ctx`, the context rows any block can see."""
    a, v = sample_anchors(starts, lengths, anchors, generator)
    blocks, labels, ok = make_blocks(ids, a.to(ids.device), v.to(ids.device), lengths, block, mask_id)
    return {"blocks": blocks, "labels": labels, "valid": ok, "anchors": a.to(ids.device), "ctx": int(a.max()) + 1}


def attention_mask(anchors: torch.Tensor, block: int, n: int, window: int | None, causal: bool) -> torch.Tensor:
    """[S, 1, A*B, n + A*B]: query (anchor i, offset o) sees context rows j < anchor_i (inside the window) and the
    rows of its own block (causally in a causal layer, inside the window)."""
    S, A = anchors.shape
    dev = anchors.device
    q_pos = (anchors[..., None] + torch.arange(block, device=dev)).reshape(S, A * block)
    j = torch.arange(n, device=dev)
    ctx = j[None, None] < anchors.repeat_interleave(block, 1)[..., None]
    if window is not None:
        ctx = ctx & (q_pos[..., None] - j < window)
    bid, off = torch.arange(A * block, device=dev) // block, torch.arange(A * block, device=dev) % block
    d = off[:, None] - off[None]
    blk = bid[:, None] == bid[None]
    if causal:
        blk = blk & (d >= 0)
    if window is not None:
        blk = blk & (d.abs() < window)
    return torch.cat([ctx, blk[None].expand(S, -1, -1)], -1)[:, None]


def anchor_forward(model: DFlashDraft, embeds: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Drafter hidden states [S, A, B, h] for A blocks per row: each row's context is projected once and its A
    blocks attend to it as one query set (the reference layer maths with a block-diagonal mask)."""
    S, A, B, h = embeds.shape
    n = taps.shape[1]
    ctx = model.context(taps)                                           # [S, n, h]
    ctx_pos = torch.arange(n, device=taps.device)[None].expand(S, n)
    pos = (anchors[..., None] + torch.arange(B, device=taps.device)).reshape(S, A * B)
    x = embeds.reshape(S, A * B, h)
    masks: dict = {}
    for layer in model.layers:
        att = layer.self_attn
        key = (att.window, att.causal)
        if key not in masks:
            masks[key] = attention_mask(anchors, B, n, att.window, att.causal)
        y = layer.input_layernorm(x)
        q = rope(att.q_norm(att.q_proj(y).view(S, A * B, att.heads, att.head_dim)), pos, att.theta)
        kb, vb = att.project_kv(y, pos)
        kc, vc = att.project_kv(ctx, ctx_pos)
        rep = att.heads // att.kv_heads
        k = torch.cat([kc, kb], 1).transpose(1, 2).repeat_interleave(rep, 1)
        v = torch.cat([vc, vb], 1).transpose(1, 2).repeat_interleave(rep, 1)
        dt = v.dtype                                     # bf16 under autocast (rope leaves q, k in fp32)
        out = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), k.to(dt), v, attn_mask=masks[key])
        x = x + att.o_proj(out.transpose(1, 2).reshape(S, A * B, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).view(S, A, B, h)


def chunk_logits(model: DFlashDraft, ids: torch.Tensor, taps: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, embed: torch.Tensor, head: torch.Tensor, chunk: int) -> Iterator[tuple]:
    """For each chunk of up to `chunk` anchors per row: (rows, first anchor index, logits [s, a, B-1, V], labels,
    label validity). Rows without a valid anchor in the chunk are left out of it. CPU anchors/valid/lengths."""
    conf = model.config
    for c0 in range(0, anchors.shape[1], chunk):
        a, v = anchors[:, c0 : c0 + chunk], valid[:, c0 : c0 + chunk]
        rows = v.any(1).nonzero().squeeze(1)
        if not len(rows):
            continue
        a, v, n = a[rows], v[rows], int(a[rows].max())
        r_dev = rows.to(ids.device)
        a_dev, v_dev = a.to(ids.device), v.to(ids.device)
        blocks, labels, ok = make_blocks(ids[r_dev], a_dev, v_dev, lengths[rows], conf.block_size, conf.mask_token_id)
        embeds = F.embedding(blocks, embed).float() * conf.input_embedding_scale     # fp32 residual under autocast
        hidden = anchor_forward(model, embeds, taps[r_dev, :n], a_dev)[:, :, 1:]      # no block sees past its anchor
        flat = hidden.reshape(-1, hidden.shape[-1])       # a copy: on the strided 4D slice F.linear runs a batched
        yield rows, c0, F.linear(flat, head).view(*hidden.shape[:-1], -1), labels, ok    # GEMM of 15 rows each (3x slower)


def label_weight(anchors: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The step's total loss weight: sum of w_k over every valid label (known before any chunk runs)."""
    idx = anchors[..., None] + torch.arange(1, len(weights) + 1)
    ok = (idx < lengths[:, None, None]) & valid[..., None]
    return (ok.float() * weights.cpu()).sum()


def chunked_loss(model: DFlashDraft, ids: torch.Tensor, taps: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, embed: torch.Tensor, head: torch.Tensor, weights: torch.Tensor, chunk: int,
                 backward: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's position-weighted CE (detached when `backward`, which back-propagates chunk by chunk) and top-1
    accuracy per block position [B-1]."""
    total = label_weight(anchors, valid, lengths, weights).clamp(min=1e-6).to(ids.device)
    w = weights.to(ids.device)
    loss = torch.zeros((), device=ids.device)
    hits = torch.zeros(len(weights), device=ids.device)
    seen = torch.zeros(len(weights), device=ids.device)
    for _, _, logits, labels, ok in chunk_logits(model, ids, taps, lengths, anchors, valid, embed, head, chunk):
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
        part = (ce.view(labels.shape) * w * ok).sum() / total
        if backward:
            part.backward()
            part = part.detach()
        loss = loss + part
        with torch.no_grad():
            hits += ((logits.argmax(-1) == labels) & ok).sum((0, 1))
            seen += ok.sum((0, 1))
    return loss, hits / seen.clamp(min=1)
