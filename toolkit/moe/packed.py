"""The packed MoE forward: each expert a call touches is decoded once per `m` of its own rows.

The union path (union.py) multiplies every row of a call by every touched expert, so past about 16 rows its GEMMs
run at the many-row rate of exllamav3's kernel while most products are dropped. Here each touched expert gets
slots of `m` rows (its own rows, in call order, padded with zero rows), and exllamav3's multi-matrix EXL3 GEMM runs
one slot per matrix at `m` rows, the rate its kernel decodes at for a few rows. The shared expert rides along as
one more expert routed from every row, with its sigmoid gate as its weight. Four small Triton kernels do the rest on
the GPU with no host sync (packed_kernels.py: the packing, the gather of each slot's rows, the weighted sum; the
union path's activation), six launches a layer; every shape is fixed by the call's rows alone (slots past the last
live one carry index -1, which the GEMM skips), so a call can be replayed in a CUDA graph.
"""

from __future__ import annotations

import torch

from .union import Mgemm, UnionTables, Workspace, WORKSPACE, kernels as union_kernels

M = 8                       # rows per slot: exllamav3's kernel decodes at its few-row rate up to 8
CHUNK = 64                  # picks the packing ranks at a time


def slot_bound(picks: int, experts: int, m: int = M) -> int:
    """The most slots a call of `picks` (row, expert) pairs can fill: sum of ceil(n_e / m) over its distinct
    experts, at most (picks + distinct * (m - 1)) / m."""
    return (picks + min(picks, experts) * (m - 1)) // m


def kernels():
    """The Triton kernels (imported on first use: importing this module needs no Triton)."""
    from . import packed_kernels

    return packed_kernels


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pack(sel: torch.Tensor, experts: int, shared: bool, m: int, ws: Workspace = WORKSPACE):
    """(matrix per slot [S] (-1 past the live ones), gate+up matrices [1, 2S], each pick's place in the slots' rows
    [P], the row at each place [S * m] (R, a zero row, where none), live slots [1] int32) for the picks sel [R, k]
    of `experts` routed experts, plus one pick per row of the shared expert (id `experts`) when `shared`. Slots
    follow expert order; an expert's picks keep pick order."""
    rows, k = sel.shape
    dev, i32, i64 = sel.device, torch.int32, torch.int64
    n_exp, picks = experts + int(shared), rows * (k + int(shared))
    s, eb = slot_bound(picks, n_exp, m), next_pow2(n_exp + 1)
    out = (ws.get("p_matrix", (s,), i64, dev), ws.get("p_idx_gu", (1, 2 * s), i64, dev),
           ws.get("p_place", (picks,), i64, dev), ws.get("p_who", (s * m,), i64, dev), ws.get("p_live", (1,), i32, dev))
    kernels().pack_kernel[(1,)](sel.contiguous(), *out, ws.get("p_count", (eb,), i32, dev),
                                ws.get("p_rank", (picks + CHUNK,), i32, dev), rows * k, rows, s, K=k, E=experts,
                                SHARED=int(shared), M=m, CB=CHUNK, EB=eb, SB=next_pow2(s), WB=next_pow2(s * m))
    return out


def packed_forward(x: torch.Tensor, sel: torch.Tensor, weights: torch.Tensor, t: UnionTables, mgemm: Mgemm,
                   ws: Workspace = WORKSPACE, out: torch.Tensor | None = None, m: int = M) -> torch.Tensor:
    """The MoE output [R, hidden] fp32 of rows x [R, hidden] routed to sel [R, k] with weights [R, k], plus the
    shared expert when the tables hold it (into `out` when given)."""
    k_ = kernels()
    rows, topk = sel.shape
    dev, H, I, f16 = x.device, t.hidden, t.inter, torch.float16
    x = x.reshape(rows, H).to(f16).contiguous()
    matrix, idx_gu, place, who, live = pack(sel, t.experts, t.shared, m, ws)
    s = matrix.shape[0]
    a = ws.get("p_a", (s, 2, m, H), f16, dev)
    k_.gather_kernel[(s * m,)](x, who, live, a, rows, HID=H, M=m, BH=min(1024, next_pow2(H)), num_warps=4)
    gu, p = ws.get("p_gu", (2 * s, m, I), f16, dev), t.gate_up
    mgemm(a.view(2 * s, m, H), p.trellis, gu, p.suh, ws.get("p_had_gu", (2 * s, m, H), f16, dev), p.svh, idx_gu,
          None, p.K, -1, p.mcg, p.mul1, -1, -1, 0)
    act = ws.get("p_act", (s, m, I), f16, dev)
    union_kernels().act_kernel[(s,)](gu, act, live, m, INT=I, BR=min(16, m), num_warps=4)
    dn, p = ws.get("p_dn", (s, m, H), torch.float32, dev), t.down
    mgemm(act, p.trellis, dn, p.suh, ws.get("p_had_d", (s, m, I), f16, dev), p.svh, matrix.view(1, s), None, p.K,
          -1, p.mcg, p.mul1, -1, -1, 0)
    out = torch.empty((rows, H), dtype=torch.float32, device=dev) if out is None else out
    bh = next(b for b in (512, 256, 128) if H % b == 0)
    gated = t.shared_gate is not None
    k_.combine_kernel[(rows, H // bh)](dn, place, weights.contiguous(), x, t.shared_gate if gated else x, out,
                                       rows * topk, HID=H, TOPK=topk, SHARED=int(t.shared), GATED=gated, BH=bh,
                                       HB=next_pow2(H))
    return out
