"""The expert-grouped EXL3 MoE path (toolkit/moe/grouped*.py) on the CPU: its Triton kernels run under
TRITON_INTERPRET=1 against the torch reference. The decode must be bit-exact on every codebook and bitrate the
converter writes; the MoE forward must match the reference to fp16 rounding (the lever: test_moe_lever.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from toolkit.moe import grouped as gm  # noqa: E402
from toolkit.moe.ref import (RATES, random_layer, random_linear, ref_moe, split_rate,  # noqa: E402
                                          tile_states, window_ends, inner_weight)
from toolkit.synthetic import codebook as synth_cb  # noqa: E402

import moe_fakes as fakes  # noqa: E402
from moe_fakes import HID, INT, EXPERTS, TOPK, assert_close, routed  # noqa: E402,F401

KERNELS = "toolkit.moe.grouped_kernels"
FORMATS = [(cb, K) for cb in ("mul1", "mcg", "3inst") for K in RATES if cb == "mul1" or K == int(K)]


interpreted = fakes.interpreted_fixture(KERNELS)


@pytest.fixture(scope="module")
def layer():
    return random_layer(HID, INT, EXPERTS, 4, "mul1", seed=1)


# -- the reference's reading of the format --------------------------------------------------------------------


def test_reference_reads_integer_rates_as_the_synthetic_decoder():
    g = torch.Generator().manual_seed(0)
    for K in range(1, 9):
        tiles = torch.randint(-32768, 32768, (3, 16 * K), dtype=torch.int16, generator=g)
        assert torch.equal(tile_states(tiles, K), synth_cb.tile_states(tiles, K))


@pytest.mark.parametrize("K", [1.5, 2.5, 3.5] + list(range(1, 9)))
def test_each_window_ends_with_its_own_symbol(K):
    # pack symbols as exllamav3's pack_trellis(_frac) kernels do: D(p) bits each, MSB first, uint32 words
    ka, half = split_rate(K)
    g = torch.Generator().manual_seed(int(K * 2))
    d = ka + half * (torch.arange(256) % 2)
    sym = torch.randint(0, 1 << 16, (256,), generator=g) & ((1 << d) - 1)
    bits = torch.cat([(s >> torch.arange(int(n) - 1, -1, -1)) & 1 for s, n in zip(sym, d)])
    assert bits.numel() == int(window_ends(K)[-1])
    u16 = (bits.view(-1, 16) << torch.arange(15, -1, -1)).sum(-1).view(-1, 2).flip(-1).flatten()
    states = tile_states(u16.to(torch.int32).to(torch.int16), K)
    assert torch.equal(states & ((1 << d) - 1), sym)


# -- decode: bit-exact ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("codebook", ["mul1", "mcg", "3inst"])
def test_codebook_on_every_state(interpreted, codebook):
    states = torch.arange(65536, dtype=torch.int32)
    out = torch.empty(65536, dtype=torch.float16)
    cb = {"3inst": 0, "mcg": 1, "mul1": 2}[codebook]
    interpreted.codebook_kernel[(16,)](states, out, 65536, CB=cb, BLOCK=4096)
    ref = synth_cb.decode_states(states, codebook)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("codebook,K", FORMATS)
def test_decode_is_bit_exact(codebook, K):
    lin = random_linear(64, 128, K, codebook, torch.Generator().manual_seed(7))
    out = gm.decode_inner(lin, asm=False)
    assert torch.equal(out.view(torch.int16), inner_weight(lin.trellis, K, codebook).view(torch.int16))


# -- the grouped forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [2, 8, 16, 64])
def test_forward_matches_reference(layer, rows):
    x, sel, w = routed(rows, seed=rows)
    tables = gm.build_tables(layer, x.device)
    assert tables.shared and tables.shared_gate is not None
    assert_close(gm.grouped_forward(x, sel, w, tables, gm.KernelConfig(asm=False, bk=128)), ref_moe(x, sel, w, layer))


@pytest.mark.parametrize("codebook,K,shared", [("mcg", 3, True), ("3inst", 2, False), ("mul1", 2.5, True),
                                               ("mul1", 7, False), ("mcg", 6, True)])
def test_forward_in_other_formats(codebook, K, shared):
    lay = random_layer(HID, INT, EXPERTS, K, codebook, seed=3, shared=shared, gated_shared=False)
    x, sel, w = routed(8, seed=5)
    cfg = gm.KernelConfig(asm=False, bk=32)
    assert_close(gm.grouped_forward(x, sel, w, gm.build_tables(lay, x.device), cfg), ref_moe(x, sel, w, lay))


def test_one_expert_takes_every_row_and_most_take_none(layer):
    x, sel, w = routed(40, seed=11)
    sel[:, 0] = 5                                      # every row: expert 5 (40 rows: three row blocks of 16)
    sel[:, 1] = torch.where(torch.arange(40) % 2 == 0, 2, 6)    # experts 0, 1, 3, 4, 7: no rows
    assert_close(gm.grouped_forward(x, sel, w, gm.build_tables(layer, x.device)), ref_moe(x, sel, w, layer))


def test_sort_groups_every_pick(interpreted, layer):
    x, sel, w = routed(16, seed=13)
    sel[3] = torch.tensor([4, 4])                      # a repeated expert in a row (top-k never does this) still sums
    t = gm.build_tables(layer, x.device)
    assert_close(gm.grouped_forward(x, sel, w, t), ref_moe(x, sel, w, layer))
    a, total = sel.numel(), sel.numel() + 16
    ws = gm.workspace(x.device, total, min(EXPERTS, a) + 1, HID, INT, EXPERTS)
    n = int(ws["n_active"][0])
    counts = torch.bincount(sel.flatten(), minlength=EXPERTS)
    seg = ws["seg"].view(3, -1)[:, :n]
    assert seg[0].tolist() == (counts > 0).nonzero().flatten().tolist() + [EXPERTS]       # the shared expert last
    assert (seg[2] - seg[1]).tolist() == counts[counts > 0].tolist() + [16]
    slot = ws["slot_of"][:a].long()
    assert torch.equal(ws["tok"][slot].long(), torch.arange(a) // TOPK)
    assert torch.equal(ws["exp"][slot].long(), sel.flatten())


def test_mixed_formats_are_refused(layer):
    odd = random_layer(HID, INT, 1, 3, "mul1", seed=2, shared=False)
    mixed = gm.MoeLayer(layer.gates[:-1] + odd.gates, layer.ups, layer.downs)
    with pytest.raises(ValueError, match="mix EXL3 formats"):
        gm.build_tables(mixed, torch.device("cpu"))
