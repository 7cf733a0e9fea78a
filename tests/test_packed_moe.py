"""The packed MoE path (toolkit/moe/packed*.py) on the CPU: its Triton kernels and the union path's activation under
TRITON_INTERPRET=1 and exllamav3's multi-matrix GEMM by a torch reference (moe_fakes.RefMgemm), against the float64
reference of the layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import moe_fakes as fakes  # noqa: E402
from moe_fakes import EXPERTS, HID, INT, FORMATS, RefMgemm, assert_close, routed  # noqa: E402
from toolkit.moe import packed as pk  # noqa: E402
from toolkit.moe import union as un  # noqa: E402
from toolkit.moe.ref import random_layer, ref_moe  # noqa: E402

@pytest.fixture(scope="module", autouse=True)
def interpreted():
    with fakes.interpreted("toolkit.moe.union_kernels"), fakes.interpreted("toolkit.moe.packed_kernels"):
        yield


@pytest.fixture(scope="module")
def layer():
    return random_layer(HID, INT, EXPERTS, 4, "mcg", seed=3)


def run(layer, x, sel, w, m=4):
    t = un.build_tables(layer, torch.device("cpu"))
    mg = RefMgemm(t.keep)
    return pk.packed_forward(x, sel, w, t, mg, un.Workspace(), m=m), mg, t


def expected(sel, E: int, shared: bool, m: int):
    """(matrix per live slot, its rows) in expert order, an expert's picks in pick order (the shared expert's after
    every routed pick, one per row)."""
    rows, k = sel.shape
    picks = [(int(sel[r, j]), r) for r in range(rows) for j in range(k)] + [(E, r) for r in range(rows) if shared]
    want = []
    for e in range(E + shared):
        mine = [(i, r) for i, (x, r) in enumerate(picks) if x == e]
        want += [(e, mine[i:i + m]) for i in range(0, len(mine), m)]
    return want, len(picks)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("rows", [1, 7, 30])                   # 30 rows: more picks than the packing takes at a time
def test_pack_gives_each_expert_its_own_rows_in_slots_of_m(rows, m, shared):
    E, k = 16, 3
    g = torch.Generator().manual_seed(rows * 10 + m)
    sel = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
    matrix, idx_gu, place, who, live = pk.pack(sel, E, shared, m, un.Workspace())
    want, picks = expected(sel, E, shared, m)
    s = matrix.shape[0]
    assert s == pk.slot_bound(picks, E + shared, m) and int(live) == len(want) <= s
    assert matrix.tolist() == [e for e, _ in want] + [-1] * (s - len(want))
    ups = [e + E + shared if e >= 0 else -1 for e in matrix.tolist()]
    assert idx_gu[0, 0::2].tolist() == matrix.tolist() and idx_gu[0, 1::2].tolist() == ups
    for slot, (e, mine) in enumerate(want):
        assert who[slot * m:(slot + 1) * m].tolist() == [r for _, r in mine] + [rows] * (m - len(mine))
        assert [int(place[i]) for i, _ in mine] == list(range(slot * m, slot * m + len(mine)))
    assert who[len(want) * m:].tolist() == [rows] * ((s - len(want)) * m)


def test_the_slot_bound_holds_for_the_worst_routing():
    """Every expert as many picks as can be, each one past a multiple of m: the most slots a call can fill."""
    E, m = 16, 4
    for rows in (1, 9, 40):
        sel = (torch.arange(rows * 2) % E).view(rows, 2)
        _, _, _, _, live = pk.pack(sel, E, False, m, un.Workspace())
        assert int(live) <= pk.slot_bound(rows * 2, E, m)


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


@pytest.mark.parametrize("codebook,K,shared,gated", FORMATS)
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
