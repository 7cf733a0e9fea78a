"""The packed MoE forward: each expert a call touches is decoded once per `m` of its own rows.

The union path (union.py) multiplies every row of a call by every touched expert, so past about 16 rows its GEMMs
run at the many-row rate of exllamav3's kernel while most products are dropped. Here each touched expert gets
slots of `m` rows (its own rows, in call order, padded with zero rows), and exllamav3's multi-matrix EXL3 GEMM runs
one slot per matrix at `m` rows, the rate its kernel decodes at for a few rows. The shared expert rides along as
one more expert routed from every row, with its sigmoid gate as its weight. The packing, the activation and the
weighted sum run on the GPU with no host sync; every shape is fixed by the call's rows alone (slots past the last
live one carry index -1, which the GEMM skips), so a call can be replayed in a CUDA graph.
"""

from __future__ import annotations

import torch

from .union import Mgemm, UnionTables, Workspace, WORKSPACE, kernels

M = 8                       # rows per slot: exllamav3's kernel decodes at its few-row rate up to 8


def slot_bound(picks: int, experts: int, m: int = M) -> int:
    """The most slots a call of `picks` (row, expert) pairs can fill: sum of ceil(n_e / m) over its distinct
    experts, at most (picks + distinct * (m - 1)) / m."""
    return (picks + min(picks, experts) * (m - 1)) // m


def pack(sel: torch.Tensor, experts: int, m: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """(matrix per slot [slots] (-1 past the live ones), each pick's place in the slots' rows [P], the pick's row
    at each place [slots * m] (rows = R, a zero row, where none), live slots [1] int32) for picks sel [R, k]
    of `experts` experts. Slots follow expert order; an expert's rows keep call order."""
    rows, k = sel.shape
    e = sel.reshape(-1).to(torch.int64)
    ids = torch.arange(experts, device=sel.device)
    hit = (e[:, None] == ids[None, :]).to(torch.int32)            # [P, E]: no one_hot, whose checks may sync
    seen = hit.cumsum(0)
    rank = seen.gather(1, e[:, None]).squeeze(1).to(torch.int64) - 1
    per = (seen[-1].to(torch.int64) + m - 1) // m                 # slots per expert
    base = per.cumsum(0) - per
    slot = base[e] + rank // m
    place = slot * m + rank % m
    matrix = torch.full((slots,), -1, dtype=torch.int64, device=sel.device).scatter_(0, slot, e)
    who = torch.full((slots * m,), rows, dtype=torch.int64, device=sel.device)
    who.scatter_(0, place, torch.arange(rows * k, device=sel.device) // k)
    return matrix, place, who, per.sum().to(torch.int32).view(1)


def with_shared(x: torch.Tensor, sel: torch.Tensor, weights: torch.Tensor, t: UnionTables):
    """The picks with the shared expert (id `t.experts`) as one more per row, weighted by its sigmoid gate."""
    if not t.shared:
        return sel, weights.float()
    rows = sel.shape[0]
    own = torch.full((rows, 1), t.experts, dtype=sel.dtype, device=sel.device)
    gate = torch.sigmoid(x.float() @ t.shared_gate.float()).view(rows, 1) if t.shared_gate is not None else \
        torch.ones((rows, 1), device=x.device)
    return torch.cat([sel, own], 1), torch.cat([weights.float(), gate], 1)


def packed_forward(x: torch.Tensor, sel: torch.Tensor, weights: torch.Tensor, t: UnionTables, mgemm: Mgemm,
                   ws: Workspace = WORKSPACE, out: torch.Tensor | None = None, m: int = M) -> torch.Tensor:
    """The MoE output [R, hidden] fp32 of rows x [R, hidden] routed to sel [R, k] with weights [R, k], plus the
    shared expert when the tables hold it (into `out` when given)."""
    rows = sel.shape[0]
    dev, H, I = x.device, t.hidden, t.inter
    x = x.reshape(rows, H).to(torch.float16).contiguous()
    sel, w = with_shared(x, sel.contiguous(), weights.contiguous(), t)
    k = sel.shape[1]
    n_exp = t.experts + int(t.shared)
    s = slot_bound(rows * k, n_exp, m)
    matrix, place, who, live = pack(sel, n_exp, m, s)
    up = torch.where(matrix >= 0, matrix + n_exp, matrix)
    idx_gu = torch.stack([matrix, up], 1).view(1, 2 * s)
    f16 = torch.float16
    xz = torch.cat([x, x.new_zeros((1, H))])
    a = ws.get("p_a", (s, 2, m, H), f16, dev)
    a.copy_(xz[who].view(s, 1, m, H).expand(s, 2, m, H))
    gu, p = ws.get("p_gu", (2 * s, m, I), f16, dev), t.gate_up
    mgemm(a.view(2 * s, m, H), p.trellis, gu, p.suh, ws.get("p_had_gu", (2 * s, m, H), f16, dev), p.svh, idx_gu,
          None, p.K, -1, p.mcg, p.mul1, -1, -1, 0)
    act = ws.get("p_act", (s, m, I), f16, dev)
    kernels().act_kernel[(s,)](gu, act, live, m, INT=I, BR=min(16, m), num_warps=4)
    dn, p = ws.get("p_dn", (s, m, H), torch.float32, dev), t.down
    mgemm(act, p.trellis, dn, p.suh, ws.get("p_had_d", (s, m, I), f16, dev), p.svh, matrix.view(1, s), None, p.K,
          -1, p.mcg, p.mul1, -1, -1, 0)
    picked = dn.view(s * m, H)[place].view(rows, k, H)
    out = torch.empty((rows, H), dtype=torch.float32, device=dev) if out is None else out
    return torch.sum(picked * w.view(rows, k, 1), 1, out=out)
