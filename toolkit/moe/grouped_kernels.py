"""Triton kernels of the expert-grouped EXL3 MoE forward (the host side and the lever are in grouped_moe.py, the
format in grouped_moe_ref.py). Every kernel also runs under TRITON_INTERPRET=1 on a CPU.

Decode: a block of BK x BN inner weights is decoded as a 4-d tensor [BK/RG, RG, BN/CG, CG] in which each
(d0, d2) element is a group of G = RG*CG consecutive trellis positions (one tensor-core lane's run) whose windows
lie in two consecutive 32-bit words: two loads per group, then per weight a 64-bit shift of the word pair and
the codebook. With exllamav3's PTX (shr.b64, dp4a / lop3, fma.f16) that is about five instructions a weight at
4 bits, as in its own kernels; the portable form (the only one the interpreter runs) about twice that. Flattened to [BK, BN] the rows and columns of every 16x16 tile come out in a fixed permuted order
(row' = r2 r1 r3 r0, col' = c2 c1 c0 c3 in bits); the GEMMs never undo it: the 128-point Hadamard matrices that
rotate their inputs and outputs are permuted to match (grouped_moe.hadamards).
"""

from __future__ import annotations

import triton
import triton.language as tl

MUL1_K_INV = tl.constexpr(1774.0 / 262144.0)        # fp16 0x1EEE exactly
MUL1_BIAS = tl.constexpr(-10.3828125)               # fp16 0xC931 exactly
HAD_SCALE = tl.constexpr(0.08838834764831845)        # 1 / sqrt(128)


# -- decode ----------------------------------------------------------------------------------------------------


@triton.jit
def _window_end(p, KA: tl.constexpr, HALF: tl.constexpr):
    # ring bit after position p's window: KA bits per position, one more on odd positions at the half rates
    return (p + 1) * KA + HALF * ((p + 1) // 2)


@triton.jit
def _tile_bits(BK: tl.constexpr, BN: tl.constexpr, RG: tl.constexpr, CG: tl.constexpr):
    """Tile coordinates of the 4-d decode block: (tile row, tile col, row bits r3..r0, col bits c3..c0)."""
    d0 = tl.arange(0, BK // RG)[:, None, None, None]
    d1 = tl.arange(0, RG)[None, :, None, None]
    d2 = tl.arange(0, BN // CG)[None, None, :, None]
    d3 = tl.arange(0, CG)[None, None, None, :]
    if RG == 4:
        tk, r2, r1, r3, r0 = d0 // 4, (d0 // 2) % 2, d0 % 2, d1 // 2, d1 % 2
    else:
        tk, r2, r1, r3, r0 = d0 // 8, (d0 // 4) % 2, (d0 // 2) % 2, d0 % 2, d1
    if CG == 2:
        tn, c2, c1, c0, c3 = d2 // 8, (d2 // 4) % 2, (d2 // 2) % 2, d2 % 2, d3
    else:
        tn, c2, c1, c0, c3 = d2 // 16, (d2 // 8) % 2, (d2 // 4) % 2, (d2 // 2) % 2, d2 % 2
    return tk, tn, r3, r2, r1, r0, c3, c2, c1, c0


@triton.jit
def _decode_setup(tiles_n, KA: tl.constexpr, HALF: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                  RG: tl.constexpr, CG: tl.constexpr):
    """Per-block constants of the decode (the same for every block): each group's two word offsets relative to the
    block's first tile, and the shift that ends each weight's window at bit 0 as (group part, in-group part)."""
    W = 8 * KA + 4 * HALF                              # uint32 words per tile
    L = 32 * W                                         # ring bits per tile
    tk, tn, r3, r2, r1, r0, c3, c2, c1, c0 = _tile_bits(BK, BN, RG, CG)
    pg = 8 * r1 + 16 * r2 + 32 * c0 + 64 * c1 + 128 * c2     # the group's first position ...
    if RG == 2:
        pg += 2 * r3
    if CG == 1:
        pg += 4 * c3
    j = r0                                                    # ... and each weight's place in it
    if RG == 4:
        j += 2 * r3
    if CG == 2:
        j += 4 * c3
    first = (_window_end(pg, KA, HALF) - 16 + L) // 32        # unwrapped index of the group's first word
    tile = (tk * tiles_n + tn) * W
    off_a = tile + first % W
    off_b = tile + (first + 1) % W
    # right shift of the 64-bit word pair that ends each weight's window at bit 0 (0..48): a group part and a
    # part within the group, kept apart so that neither is a full-size tensor. When every group starts at the
    # same bit of its word (G*K a multiple of 32: 4 and 8 bits) the group part is one number for the block.
    if HALF == 0 and (RG * CG * KA) % 32 == 0:
        s_group = ((KA - 16 + L) // 32) * 32 + 64 - L - KA
    else:
        s_group = first * 32 + 64 - L - _window_end(pg, KA, HALF)
    s_pos = j * KA + HALF * ((j + 1) // 2)                 # window end past the group's first (pg is even)
    return off_a, off_b, s_group, s_pos


@triton.jit
def _codebook(st, CB: tl.constexpr):
    """fp16 value of 16-bit states (uint32) in codebook CB (0 3INST, 1 MCG, 2 MUL1), computed exactly in fp32."""
    if CB == 2:
        x = st * 0x83DCD12D
        s = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
        s = (s & 0xFFFF) + (s >> 16) + 1024
        f = (s | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return (f * MUL1_K_INV + MUL1_BIAS).to(tl.float16)
    else:
        if CB == 1:
            x = st * 0xCBAC1FED
        else:
            x = st * 89226354 + 64248484
        x = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return (lo + hi).to(tl.float16)


@triton.jit
def _codebook_asm(lo, hi, s, CB: tl.constexpr):
    """_codebook((((hi:lo) >> s) & 0xFFFF) for s in 0..48, in the instructions exllamav3 uses (NVIDIA only)."""
    if CB == 2:
        return tl.inline_asm_elementwise(
            "{ .reg .b64 d; .reg .b32 t, m; .reg .b16 h, k, c;"
            " mov.b64 d, {$1, $2}; shr.b64 d, d, $3; cvt.u32.u64 t, d; and.b32 t, t, 65535; mul.lo.u32 m, t, 0x83DCD12D;"
            " dp4a.u32.u32 t, m, 0x01010101, 0x6400; cvt.u16.u32 h, t;"
            " mov.b16 k, 0x1EEE; mov.b16 c, 0xC931; fma.rn.f16 $0, h, k, c; }",
            "=h,r,r,r", [lo, hi, s], dtype=tl.float16, is_pure=True, pack=1)
    elif CB == 1:
        return tl.inline_asm_elementwise(
            "{ .reg .b64 d; .reg .b32 t; .reg .b16 l, h;"
            " mov.b64 d, {$1, $2}; shr.b64 d, d, $3; cvt.u32.u64 t, d; and.b32 t, t, 65535; mul.lo.u32 t, t, 0xCBAC1FED;"
            " and.b32 t, t, 0x8FFF8FFF; xor.b32 t, t, 0x3B603B60; mov.b32 {l, h}, t; add.rn.f16 $0, l, h; }",
            "=h,r,r,r", [lo, hi, s], dtype=tl.float16, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b64 d; .reg .b32 t; .reg .b16 l, h;"
            " mov.b64 d, {$1, $2}; shr.b64 d, d, $3; cvt.u32.u64 t, d; and.b32 t, t, 65535; mad.lo.u32 t, t, 89226354, 64248484;"
            " and.b32 t, t, 0x8FFF8FFF; xor.b32 t, t, 0x3B603B60; mov.b32 {l, h}, t; add.rn.f16 $0, l, h; }",
            "=h,r,r,r", [lo, hi, s], dtype=tl.float16, is_pure=True, pack=1)


@triton.jit
def _decode_step(words, base, off_a, off_b, s_group, s_pos, CB: tl.constexpr, ASM: tl.constexpr):
    """One 4-d block of fp16 weights, `base` the uint32 offset of its first tile."""
    a = tl.load(words + base + off_a)
    b = tl.load(words + base + off_b)
    s = s_group - s_pos
    if ASM:
        return _codebook_asm(b, a, s.to(tl.uint32), CB)              # one 64-bit shift: no select
    lo = tl.where(s < 32, b, a)
    s = (s % 32).to(tl.uint32)
    st = ((lo >> s) | ((a << 1) << (31 - s))) & 0xFFFF
    return _codebook(st, CB)


@triton.jit
def codebook_kernel(states, out, n, CB: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = codebook(states[i]): the exhaustive test of _codebook."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    st = tl.load(states + i, mask=i < n, other=0).to(tl.uint32)
    tl.store(out + i, _codebook(st, CB), mask=i < n)


@triton.jit
def decode_kernel(trellis, out, n, KA: tl.constexpr, HALF: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr,
                  BK: tl.constexpr, BN: tl.constexpr, RG: tl.constexpr, CG: tl.constexpr):
    """The inner weight [k, n] fp16 in its true order, one BK x BN block per program."""
    W = 8 * KA + 4 * HALF                              # uint32 words per tile
    words = trellis.to(tl.pointer_type(tl.uint32))
    kb, nb = tl.program_id(0), tl.program_id(1)
    off_a, off_b, s_group, s_pos = _decode_setup(n // 16, KA, HALF, BK, BN, RG, CG)
    base = ((kb * BK // 16) * (n // 16) + nb * BN // 16) * W
    v = _decode_step(words, base, off_a, off_b, s_group, s_pos, CB, ASM)
    tk, tn, r3, r2, r1, r0, c3, c2, c1, c0 = _tile_bits(BK, BN, RG, CG)
    row = kb * BK + tk * 16 + r3 * 8 + r2 * 4 + r1 * 2 + r0
    col = nb * BN + tn * 16 + c3 * 8 + c2 * 4 + c1 * 2 + c0
    tl.store(out + row * n + col, v)


# -- the grouped MoE forward -------------------------------------------------------------------------------------


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def route_kernel(sel, wts, tok_out, w_out, e_out, slot_of, seg, n_active, count, start, A, TOTAL, S,
                 E: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, EB: tl.constexpr):
    """Group the A = rows*TOPK picks (plus picks A..TOTAL-1: the shared expert, id E, weight 1) by expert in one
    program: each pick's slot (its expert's first slot + its arrival among the expert's picks), the token, weight
    and expert per slot, and per active expert in id order its id, first slot and end slot (n_active of them).
    The order of an expert's rows changes no result: every GEMM row is computed alone."""
    i = tl.arange(0, BLOCK)
    ok = i < TOTAL
    routed = i < A
    e = tl.where(routed, tl.load(sel + i, mask=routed, other=0).to(tl.int32), E)
    x = tl.arange(0, EB)
    tl.store(count + x, tl.full((EB,), 0, tl.int32))
    tl.debug_barrier()
    rank = tl.atomic_add(count + e, 1, mask=ok)
    tl.debug_barrier()
    c = tl.load(count + x)
    first = tl.associative_scan(c, 0, _add) - c
    tl.store(start + x, first)
    tl.debug_barrier()
    slot = tl.load(start + e, mask=ok, other=0) + rank
    tl.store(slot_of + i, slot, mask=ok)
    tl.store(tok_out + slot, tl.where(routed, i // TOPK, i - A), mask=ok)
    tl.store(w_out + slot, tl.load(wts + i, mask=routed, other=1.0).to(tl.float32), mask=ok)
    tl.store(e_out + slot, e, mask=ok)
    live = c > 0
    k = tl.associative_scan(live.to(tl.int32), 0, _add) - 1
    tl.store(seg + k, x, mask=live)
    tl.store(seg + S + k, first, mask=live)
    tl.store(seg + 2 * S + k, first + c, mask=live)
    tl.store(n_active, tl.reduce(live.to(tl.int32), 0, _add))


@triton.jit
def rotate_kernel(x, tok, exp, g_suh, u_suh, had_in, xg, xu, HID: tl.constexpr, HB: tl.constexpr):
    """Per sorted slot: the gate's and the up's rotated input had(x[token] * suh[expert]) in permuted order."""
    pos = tl.program_id(0)
    t = tl.load(tok + pos)
    e = tl.load(exp + pos)
    rb = tl.arange(0, HB)[:, None]
    c = tl.arange(0, 128)[None, :]
    m = rb < HID // 128
    idx = rb * 128 + c
    v = tl.load(x + t * HID + idx, mask=m, other=0.0).to(tl.float16).to(tl.float32)
    h = tl.load(had_in + tl.arange(0, 128)[:, None] * 128 + c)
    gs = tl.load(tl.load(g_suh + e).to(tl.pointer_type(tl.float16)) + idx, mask=m, other=0.0).to(tl.float32)
    rg = tl.dot((v * gs).to(tl.float16), h) * HAD_SCALE
    tl.store(xg + pos * HID + idx, rg.to(tl.float16), mask=m)
    us = tl.load(tl.load(u_suh + e).to(tl.pointer_type(tl.float16)) + idx, mask=m, other=0.0).to(tl.float32)
    ru = tl.dot((v * us).to(tl.float16), h) * HAD_SCALE
    tl.store(xu + pos * HID + idx, ru.to(tl.float16), mask=m)


@triton.jit
def _rows(seg, n_active, S):
    slot = tl.program_id(0)
    live = slot < tl.load(n_active)
    slot = tl.where(live, slot, 0)
    e = tl.load(seg + slot)
    start = tl.load(seg + S + slot)
    end = tl.where(live, tl.load(seg + 2 * S + slot), start)     # a dead program loops over no rows
    return e, start, end


@triton.jit
def _square(h):
    r = tl.arange(0, 128)
    return tl.load(h + r[:, None] * 128 + r[None, :])


@triton.jit
def _vector(table, e, n):
    """fp32 of an expert's fp16 vector (its suh or svh, pointer table `table`) at columns n."""
    return tl.load(tl.load(table + e).to(tl.pointer_type(tl.float16)) + n).to(tl.float32)


@triton.jit
def _gemm(x, words, rows, rm, nb, off_a, off_b, s_group, s_pos, K_DIM: tl.constexpr, TILES_N: tl.constexpr,
          W: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """x[rows, :K_DIM] @ the inner weight's 128 columns of block nb, fp32 [BM, 128] in the decode's column order."""
    kk = tl.arange(0, BK)
    acc = tl.full((BM, 128), 0.0, tl.float32)
    for k0 in range(0, K_DIM, BK):
        a = tl.load(x + rows[:, None] * K_DIM + k0 + kk[None, :], mask=rm, other=0.0)
        base = ((k0 // 16) * TILES_N + nb * 8) * W
        w = tl.reshape(_decode_step(words, base, off_a, off_b, s_group, s_pos, CB, ASM), (BK, 128))
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def gate_up_kernel(xg, xu, act, seg, n_active, g_tab, u_tab, g_svh, u_svh, d_suh, had_in, had_out, S,
                   HID: tl.constexpr, INT: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr,
                   CB: tl.constexpr, ASM: tl.constexpr, RG: tl.constexpr, CG: tl.constexpr, BM: tl.constexpr,
                   BK: tl.constexpr):
    """Per (active expert, 128 intermediate columns): gate and up GEMMs over all the expert's rows with each
    weight decoded once per row block, then had * svh, silu(g) * u, * the down's suh and had: the down's input."""
    W = 8 * KA + 4 * HALF                              # uint32 words per tile
    e, start, end = _rows(seg, n_active, S)
    nb = tl.program_id(1)
    gw = tl.load(g_tab + e).to(tl.pointer_type(tl.uint32))
    uw = tl.load(u_tab + e).to(tl.pointer_type(tl.uint32))
    off_a, off_b, s_group, s_pos = _decode_setup(INT // 16, KA, HALF, BK, 128, RG, CG)
    n = nb * 128 + tl.arange(0, 128)
    for m0 in range(start, end, BM):
        rows = m0 + tl.arange(0, BM)
        rm = (rows < end)[:, None]
        # one matrix per loop: both in one loop would double what is live in it (registers)
        acc_g = _gemm(xg, gw, rows, rm, nb, off_a, off_b, s_group, s_pos, HID, INT // 16, W, CB, ASM, BM, BK)
        acc_u = _gemm(xu, uw, rows, rm, nb, off_a, off_b, s_group, s_pos, HID, INT // 16, W, CB, ASM, BM, BK)
        # epilogue operands loaded here, not ahead of the loop: two 128x128 matrices would hold 128 registers
        h_out = _square(had_out)
        gsv = _vector(g_svh, e, n)
        usv = _vector(u_svh, e, n)
        g = (tl.dot(acc_g.to(tl.float16), h_out) * HAD_SCALE).to(tl.float16).to(tl.float32) * gsv[None, :]
        u = (tl.dot(acc_u.to(tl.float16), h_out) * HAD_SCALE).to(tl.float16).to(tl.float32) * usv[None, :]
        g = g.to(tl.float16).to(tl.float32)
        u = u.to(tl.float16).to(tl.float32)
        hmid = (g / (1.0 + tl.exp(-g))).to(tl.float16).to(tl.float32) * u
        hmid = (hmid.to(tl.float16).to(tl.float32) * _vector(d_suh, e, n)[None, :]).to(tl.float16)
        out = (tl.dot(hmid, _square(had_in)) * HAD_SCALE).to(tl.float16)
        tl.store(act + rows[:, None] * INT + n[None, :], out, mask=rm)


@triton.jit
def down_kernel(act, slots, w_sorted, seg, n_active, d_tab, d_svh, had_out, S,
                HID: tl.constexpr, INT: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr,
                CB: tl.constexpr, ASM: tl.constexpr, RG: tl.constexpr, CG: tl.constexpr, BM: tl.constexpr,
                BK: tl.constexpr):
    """Per (active expert, 128 hidden columns): the down GEMM over the expert's rows, had * svh * the routing
    weight, written to each assignment's own fp32 slot row (summed per token by combine_kernel)."""
    W = 8 * KA + 4 * HALF                              # uint32 words per tile
    e, start, end = _rows(seg, n_active, S)
    nb = tl.program_id(1)
    dw = tl.load(d_tab + e).to(tl.pointer_type(tl.uint32))
    off_a, off_b, s_group, s_pos = _decode_setup(HID // 16, KA, HALF, BK, 128, RG, CG)
    n = nb * 128 + tl.arange(0, 128)
    for m0 in range(start, end, BM):
        rows = m0 + tl.arange(0, BM)
        rm = rows < end
        acc = _gemm(act, dw, rows, rm[:, None], nb, off_a, off_b, s_group, s_pos, INT, HID // 16, W, CB, ASM, BM, BK)
        wr = tl.load(w_sorted + rows, mask=rm, other=0.0)
        y = tl.dot(acc.to(tl.float16), _square(had_out)) * HAD_SCALE * _vector(d_svh, e, n)[None, :] * wr[:, None]
        tl.store(slots + rows[:, None] * HID + n[None, :], y, mask=rm[:, None])


@triton.jit
def combine_kernel(slots, slot_of, x, shared_gate, out, A, HID: tl.constexpr, TOPK: tl.constexpr,
                   SHARED: tl.constexpr, GATED: tl.constexpr, BH: tl.constexpr):
    """out[t] = the token's slots summed in routing order, plus its shared-expert slot times sigmoid(x . gate)."""
    t = tl.program_id(0)
    cols = tl.arange(0, BH)
    m = cols < HID
    acc = tl.full((BH,), 0.0, tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(slots + tl.load(slot_of + t * TOPK + j) * HID + cols, mask=m, other=0.0)
    if SHARED:
        y = tl.load(slots + tl.load(slot_of + A + t) * HID + cols, mask=m, other=0.0)
        if GATED:
            z = tl.load(x + t * HID + cols, mask=m, other=0.0).to(tl.float32)
            z = z * tl.load(shared_gate + cols, mask=m, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-tl.reduce(z, 0, _add)))
        acc += y
    tl.store(out + t * HID + cols, acc, mask=m)
