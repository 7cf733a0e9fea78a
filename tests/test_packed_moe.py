"""The packed MoE path (toolkit/moe/packed.py) on the CPU: its packing, exllamav3's multi-matrix GEMM by a torch
reference (moe_fakes.RefMgemm) and the union path's activation kernel under TRITON_INTERPRET=1, against the float64
reference of the layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import moe_fakes as fakes  # noqa: E402
from moe_fakes import EXPERTS, HID, INT, RefMgemm, assert_close, routed  # noqa: E402
from toolkit.moe import packed as pk  # noqa: E402
from toolkit.moe import union as un  # noqa: E402
from toolkit.moe.ref import random_layer, ref_moe  # noqa: E402

interpreted = fakes.interpreted_fixture("toolkit.moe.union_kernels")


@pytest.fixture(scope="module")
def layer():
    return random_layer(HID, INT, EXPERTS, 4, "mcg", seed=3)


def run(layer, x, sel, w, m=4):
    t = un.build_tables(layer, torch.device("cpu"))
    mg = RefMgemm(t.keep)
    return pk.packed_forward(x, sel, w, t, mg, un.Workspace(), m=m), mg, t


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("rows", [1, 3, 7, 40])
def test_pack_gives_each_expert_its_own_rows_in_slots_of_m(rows, m):
    E, k = 16, 3
    g = torch.Generator().manual_seed(rows * 10 + m)
    sel = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
    s = pk.slot_bound(rows * k, E, m)
    matrix, place, who, live = pk.pack(sel, E, m, s)
    want = []                                   # (expert, its rows) per slot, in expert order
    for e in range(E):
        mine = [r for r in range(rows) for j in range(k) if int(sel[r, j]) == e]
        want += [(e, mine[i:i + m]) for i in range(0, len(mine), m)]
    assert int(live) == len(want) <= s
    worst = torch.arange(rows * k) % min(E, rows * k)           # as many experts as can be, each one row past m
    assert pk.pack(worst.view(rows, k), E, m, s)[3] <= s
    assert matrix.tolist() == [e for e, _ in want] + [-1] * (s - len(want))
    for slot, (e, mine) in enumerate(want):
        assert who[slot * m:(slot + 1) * m].tolist() == mine + [rows] * (m - len(mine))
    for p in range(rows * k):                   # each pick's place holds its row, in a slot of its expert
        assert int(who[place[p]]) == p // k and int(matrix[place[p] // m]) == int(sel.view(-1)[p])
    assert len(set(place.tolist())) == rows * k


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_forward_matches_reference(layer, rows):
    x, sel, w = routed(rows, seed=rows)
    out, mg, t = run(layer, x, sel, w)
    assert out.shape == (rows, HID) and out.dtype == torch.float32 and t.shared
    assert_close(out, ref_moe(x, sel, w, layer))
    counts = [sum(int(e) == i for e in sel.flatten()) for i in range(EXPERTS)] + [rows]      # + the shared
    live = sum(-(-c // 4) for c in counts if c)
    assert mg.calls == [2 * live, live]         # each expert once per 4 of its rows, per GEMM


def test_an_expert_past_its_first_slot_and_every_expert_touched(layer):
    x, _, w = routed(12, seed=5)
    sel = torch.tensor([[0, 1]] * 6 + [[e, (e + 1) % EXPERTS] for e in range(6)])
    out, _, _ = run(layer, x, sel, w, m=2)
    assert_close(out, ref_moe(x, sel, w, layer))


@pytest.mark.parametrize("codebook,K,shared,gated", [("mul1", 2.5, True, False), ("3inst", 3, False, False),
                                                     ("mcg", 6, True, True)])
def test_other_formats_and_shared_experts(codebook, K, shared, gated):
    lay = random_layer(HID, INT, EXPERTS, K, codebook, seed=7, shared=shared, gated_shared=gated)
    x, sel, w = routed(6, seed=8)
    out, _, t = run(lay, x, sel, w)
    assert t.shared == shared
    assert_close(out, ref_moe(x, sel, w, lay))


def test_the_same_call_gives_the_same_bits_and_fills_a_given_output(layer):
    x, sel, w = routed(9, seed=11)
    first, _, t = run(layer, x, sel, w)
    out = torch.full((9, HID), float("nan"))
    got = pk.packed_forward(x, sel, w, t, RefMgemm(t.keep), un.Workspace(), out=out, m=4)
    assert got is out and torch.equal(out, first)
