"""Triton kernels around the packed MoE forward (packed.py): the packing of a call's picks into slots, the gather of
each slot's rows, and the weighted sum per row. The activation between the two GEMMs and the shared expert's gate
are the union path's (union_kernels.py). Every kernel also runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import triton
import triton.language as tl

from .union_kernels import add, gated


@triton.jit
def _pick(sel, pc, PR, R, K: tl.constexpr, E: tl.constexpr, SHARED: tl.constexpr):
    """The expert of picks `pc` (routed ones from sel, then one per row of the shared expert E; E + SHARED past the
    last) and their rows."""
    e = tl.load(sel + pc, mask=pc < PR, other=E).to(tl.int32)
    e = tl.where(pc < PR + R * SHARED, e, E + SHARED)
    return e, tl.where(pc < PR, pc // K, pc - PR)


@triton.jit
def pack_kernel(sel, matrix, idx_gu, place, who, live, count_s, rank_s, PR, R, S, K: tl.constexpr,
                E: tl.constexpr, SHARED: tl.constexpr, M: tl.constexpr, CB: tl.constexpr, EB: tl.constexpr,
                SB: tl.constexpr, WB: tl.constexpr):
    """One program. The picks are the PR = R*K routed ones in `sel`, then (SHARED) one per row of the shared expert
    (id E). Each expert gets ceil(n / M) slots, in expert order, holding its picks in pick order. Writes the matrix
    per slot (-1 past the live ones) and its gate+up pair (idx_gu: gate 2s, up 2s+1, ups after all gates), each
    pick's place (slot * M + row), the row at each place (R, a zero row, where none) and the live slots. Picks are
    ranked within their expert CB at a time (no sort: the same call packs the same way every time)."""
    NE = E + SHARED
    P = PR + R * SHARED
    s = tl.arange(0, SB)
    tl.store(matrix + s, tl.full((SB,), -1, tl.int64), mask=s < S)
    w = tl.arange(0, WB)
    tl.store(who + w, tl.full((WB,), 0, tl.int64) + R, mask=w < S * M)
    x = tl.arange(0, EB)
    cnt = tl.full((EB,), 0, tl.int32)
    tl.store(count_s + x, cnt)
    tl.debug_barrier()
    i = tl.arange(0, CB)
    for c0 in range(0, P, CB):
        e, _ = _pick(sel, c0 + i, PR, R, K, E, SHARED)
        earlier = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
        rank = tl.load(count_s + e) + tl.reduce(earlier.to(tl.int32), 1, add)
        tl.store(rank_s + c0 + i, rank, mask=c0 + i < P)
        cnt += tl.histogram(e, EB)
        tl.debug_barrier()
        tl.store(count_s + x, cnt)
        tl.debug_barrier()
    per = tl.where(x < NE, (cnt + M - 1) // M, 0)
    tl.store(count_s + x, tl.associative_scan(per, 0, add) - per)        # now each expert's first slot
    tl.debug_barrier()
    for c0 in range(0, P, CB):
        pc = c0 + i
        e, tok = _pick(sel, pc, PR, R, K, E, SHARED)
        real = pc < P
        rank = tl.load(rank_s + pc, mask=real, other=0)
        slot = tl.load(count_s + e, mask=real, other=0) + rank // M
        at = slot * M + rank % M
        tl.store(place + pc, at.to(tl.int64), mask=real)
        tl.store(who + at, tok.to(tl.int64), mask=real)
        tl.store(matrix + slot, e.to(tl.int64), mask=real & (rank % M == 0))
    tl.debug_barrier()
    m = tl.load(matrix + s, mask=s < S, other=-1)
    tl.store(idx_gu + 2 * s, m, mask=s < S)
    tl.store(idx_gu + 2 * s + 1, tl.where(m >= 0, m + NE, -1), mask=s < S)
    tl.store(live, tl.reduce(per, 0, add))


@triton.jit
def gather_kernel(x, who, live, a, R, HID: tl.constexpr, M: tl.constexpr, BH: tl.constexpr):
    """Per place i of a live slot s = i // M: its row of x (zeros for a pad) into a[s, 0, i % M] and a[s, 1, i % M]
    (the gate and up GEMMs' inputs, [S, 2, M, HID])."""
    i = tl.program_id(0)
    s, r = i // M, i % M
    if s < tl.load(live):
        t = tl.load(who + i)
        for h0 in range(0, HID, BH):
            h = h0 + tl.arange(0, BH)
            v = tl.load(x + t * HID + h, mask=(h < HID) & (h * 0 + t < R), other=0.0)    # t = R: a pad row
            tl.store(a + ((2 * s) * M + r) * HID + h, v, mask=h < HID)
            tl.store(a + ((2 * s + 1) * M + r) * HID + h, v, mask=h < HID)


@triton.jit
def combine_kernel(dn, place, wts, x, gate, out, PR, HID: tl.constexpr, TOPK: tl.constexpr, SHARED: tl.constexpr,
                   GATED: tl.constexpr, BH: tl.constexpr, HB: tl.constexpr):
    """out[r] = sum over the row's picks, in routing order, of weight * the down output at its place (dn [S*M, HID]
    fp32), plus the shared expert's (pick PR + r) times sigmoid(x[r] . gate) when GATED."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = tl.full((BH,), 0.0, tl.float32)
    for j in tl.static_range(TOPK):
        at = tl.load(place + r * TOPK + j)
        acc += tl.load(wts + r * TOPK + j).to(tl.float32) * tl.load(dn + at * HID + cols)
    if SHARED:
        y = tl.load(dn + tl.load(place + PR + r) * HID + cols)
        if GATED:
            y = gated(y, x, gate, r, HID, HB)
        acc += y
    tl.store(out + r * HID + cols, acc)
