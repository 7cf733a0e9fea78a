"""Triton kernels around the union MoE forward (union.py): the union of a call's experts, the activation between
the two multi-matrix GEMMs, and the weighted sum per row. Every kernel also runs under TRITON_INTERPRET=1."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add(a, b):
    return a + b


@triton.jit
def union_kernel(sel, mark, idx_gu, idx_d, slot_of, n_active, P, E: tl.constexpr, SHARED: tl.constexpr,
                 UMAX: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, UB: tl.constexpr):
    """One program: the distinct experts of the P = rows*k picks in `sel`, in id order after the shared expert
    (slot 0 when SHARED). Writes the down GEMM's matrix per slot (idx_d, -1 past the last), the gate+up GEMM's
    two matrices per slot (idx_gu: gate 2s, up 2s+1; ups sit E+SHARED after the gates), each pick's slot and the
    number of live slots."""
    x = tl.arange(0, EB)
    tl.store(mark + x, tl.full((EB,), 0, tl.int32))
    tl.debug_barrier()
    i = tl.arange(0, PB)
    ok = i < P
    e = tl.load(sel + i, mask=ok, other=0).to(tl.int32)
    tl.store(mark + e, tl.full((PB,), 1, tl.int32), mask=ok)
    tl.debug_barrier()
    m = tl.load(mark + x)
    rank = tl.associative_scan(m, 0, add) - m + SHARED
    tl.debug_barrier()
    tl.store(mark + x, rank)
    tl.debug_barrier()
    live = m > 0
    xe = x.to(tl.int64)
    tl.store(idx_d + rank, xe, mask=live)
    tl.store(idx_gu + 2 * rank, xe, mask=live)
    tl.store(idx_gu + 2 * rank + 1, xe + E + SHARED, mask=live)
    n = tl.reduce(m, 0, add) + SHARED
    s = tl.arange(0, UB)
    pad = (s >= n) & (s < UMAX)
    if SHARED:
        first = s == 0
        tl.store(idx_d + s, tl.full((UB,), E, tl.int64), mask=first)
        tl.store(idx_gu + 2 * s, tl.full((UB,), E, tl.int64), mask=first)
        tl.store(idx_gu + 2 * s + 1, tl.full((UB,), 2 * E + 1, tl.int64), mask=first)
    neg = tl.full((UB,), -1, tl.int64)
    tl.store(idx_d + s, neg, mask=pad)
    tl.store(idx_gu + 2 * s, neg, mask=pad)
    tl.store(idx_gu + 2 * s + 1, neg, mask=pad)
    tl.store(slot_of + i, tl.load(mark + e, mask=ok, other=0), mask=ok)
    tl.store(n_active, n)


@triton.jit
def act_kernel(gu, act, n_active, R, INT: tl.constexpr, BR: tl.constexpr):
    """Per live slot s: act[s] = silu(gate) * up over all R rows, gu holding gate 2s and up 2s+1 ([2U, R, INT])."""
    s = tl.program_id(0)
    end = tl.where(s < tl.load(n_active), R, 0)           # a dead slot's program touches no row
    c = tl.arange(0, INT)[None, :]
    for r0 in range(0, R, BR):
        r = r0 + tl.arange(0, BR)[:, None]
        m = (r < end) & (c < INT)
        g = tl.load(gu + ((2 * s) * R + r) * INT + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + ((2 * s + 1) * R + r) * INT + c, mask=m, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.float16).to(tl.float32) * u
        tl.store(act + (s * R + r) * INT + c, a.to(tl.float16), mask=m)


@triton.jit
def combine_kernel(dn, slot_of, wts, x, gate, out, R, HID: tl.constexpr, TOPK: tl.constexpr,
                   SHARED: tl.constexpr, GATED: tl.constexpr, BH: tl.constexpr, HB: tl.constexpr):
    """out[r] = sum over the row's picks, in routing order, of weight * its slot's down output (dn [U, R, HID]
    fp32), plus the shared slot (0) times sigmoid(x[r] . gate) when GATED."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = tl.full((BH,), 0.0, tl.float32)
    for j in tl.static_range(TOPK):
        s = tl.load(slot_of + r * TOPK + j)
        w = tl.load(wts + r * TOPK + j).to(tl.float32)
        acc += w * tl.load(dn + (s * R + r) * HID + cols)
    if SHARED:
        y = tl.load(dn + r * HID + cols)
        if GATED:
            y = gated(y, x, gate, r, HID, HB)
        acc += y
    tl.store(out + r * HID + cols, acc)


@triton.jit
def gated(y, x, gate, r, HID: tl.constexpr, HB: tl.constexpr):
    """The shared expert's output y of row r times its gate, sigmoid(x[r] . gate) (the packed path's too)."""
    h = tl.arange(0, HB)
    hm = h < HID
    z = tl.load(x + r * HID + h, mask=hm, other=0.0).to(tl.float32)
    z = z * tl.load(gate + h, mask=hm, other=0.0).to(tl.float32)
    return y / (1.0 + tl.exp(-tl.reduce(z, 0, add)))
