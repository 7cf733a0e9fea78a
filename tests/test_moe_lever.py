"""The MoE lever on exllamav3's BlockSparseMLP (toolkit/exl3/moe.py) on a stand-in layer: each call takes the union,
packed or grouped path or exllamav3's own by its rows and the levers on; what it does not implement, or a kernel
that fails, falls back to exllamav3's forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import moe_fakes as fakes  # noqa: E402
from moe_fakes import HID, INT, EXPERTS, FakeMoE, RefMgemm, assert_close, routed  # noqa: E402
from toolkit.exl3 import moe as lever  # noqa: E402
from toolkit.moe.ref import random_layer, random_linear, ref_moe  # noqa: E402
from toolkit.moe.weights import Exl3Weight, MoeLayer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    with fakes.interpreted("toolkit.moe.grouped_kernels"), fakes.interpreted("toolkit.moe.union_kernels"), \
            fakes.interpreted("toolkit.moe.packed_kernels"):
        yield


@pytest.fixture(scope="module")
def layer():
    return random_layer(HID, INT, EXPERTS, 4, "mul1", seed=1)


def wrapped(layer, **on):
    moe = FakeMoE(layer)
    assert lever.set_paths([moe, object()], FakeMoE, on) == 1
    wrap = vars(moe)["forward"]
    wrap.mgemm = RefMgemm(lever.build("union", lever.module_layer(moe), torch.device("cpu")).keep)
    return moe, wrap


def check(moe, layer, rows: int, seed: int):
    x, _, _ = routed(rows, seed=seed)
    out = moe.forward(x.view(1, rows, HID), {})
    sel, w = moe.routing_fn(rows, None, x, {})
    assert out.shape == (1, rows, HID) and out.dtype == torch.float32
    assert_close(out.view(rows, HID), ref_moe(x, sel, w, layer))


def test_the_paths_get_the_layer_as_plain_tensors(layer):
    moe = FakeMoE(layer)
    got = lever.module_layer(moe)
    weights = got.gates + got.ups + got.downs + list(got.shared)
    assert all(type(w) is Exl3Weight for w in weights) and got.shared_gate is moe.shared_gate.inner.weight
    lin, w = moe.downs[3].inner, got.downs[3]
    assert w.trellis is lin.trellis and w.suh is lin.suh and w.svh is lin.svh   # the same tensors, not copies
    assert (w.K, w.mcg, w.mul1, w.in_features, w.out_features) == (4, False, True, INT, HID)
    import toolkit.moe.grouped as gm
    import toolkit.moe.union as un

    cpu = torch.device("cpu")
    for build in (un.build_tables, gm.build_tables):     # the kernels get the very pointers and formats as before
        a, b = build(got, cpu), build(layer, cpu)
        for f in vars(a):
            x, y = getattr(a, f), getattr(b, f)
            if f == "keep":
                assert [t.data_ptr() for t in flat(x)] == [t.data_ptr() for t in flat(y)]
            elif f in ("gate_up", "down"):
                assert all(torch.equal(getattr(x, k), getattr(y, k)) if torch.is_tensor(getattr(x, k))
                           else getattr(x, k) == getattr(y, k) for k in vars(x))
            elif f == "ptrs":
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            else:
                assert torch.equal(x, y) if torch.is_tensor(x) else x == y, f
    with pytest.raises(TypeError, match="a MoeLayer holds Exl3Weight, got SimpleNamespace"):
        MoeLayer([lin], got.ups[:1], got.downs[:1])


def flat(keep: list) -> list:
    """The tensors a table keeps alive (weights' trellis, suh, svh, or the tensors themselves)."""
    return [t for k in keep for t in ((k.trellis, k.suh, k.svh) if isinstance(k, Exl3Weight) else (k,))]


def test_union_takes_the_rows_where_it_wins(layer):
    moe, wrap = wrapped(layer, union=True)
    for rows, seed in ((1, 2), (4, 3), (12, 17), (16, 5)):            # an AR row included: 1.04x on the AR step
        check(moe, layer, rows, seed)
    x, _, _ = routed(1, seed=2)
    assert moe.forward(x.repeat(17, 1), {}) == "stock"                 # past 16 rows union loses to grouped
    assert moe.forward(x.repeat(4, 1), {"capture_sens": {}}) == "stock"    # a calibration pass
    assert lever.path_counts([moe], FakeMoE) == {"union": 4, "packed": 0, "grouped": 0, "stock": 2}


def test_grouped_takes_verify_rows_and_leaves_the_rest_stock(layer):
    moe, _ = wrapped(layer, grouped=True)
    check(moe, layer, 12, 17)
    x, _, _ = routed(8, seed=2)
    assert moe.forward(x, {}) == "stock"                               # up to 8 rows: exllamav3's own
    assert lever.path_counts([moe], FakeMoE) == {"union": 0, "packed": 0, "grouped": 1, "stock": 1}
    assert lever.set_paths([moe], FakeMoE, {"grouped": False, "union": False}) == 1 and "forward" not in vars(moe)


def test_a_path_turned_off_and_on_again_keeps_what_it_built(layer):
    moe, wrap = wrapped(layer, grouped=True)
    check(moe, layer, 12, 17)
    tables = dict(wrap.tables)
    lever.set_paths([moe], FakeMoE, {"grouped": False, "union": False})
    assert moe.forward(routed(12, seed=3)[0], {}) == "stock"            # exllamav3's own while off
    lever.set_paths([moe], FakeMoE, {"grouped": True, "union": False})
    assert vars(moe)["forward"] is wrap and wrap.tables == tables       # no rebuild: tables and graphs kept
    check(moe, layer, 12, 18)
    assert wrap.calls == {"union": 0, "packed": 0, "grouped": 2, "stock": 0}


def test_both_on_union_first(layer):
    moe, wrap = wrapped(layer, union=True, grouped=True)
    check(moe, layer, 10, 5)
    assert wrap.calls == {"union": 1, "packed": 0, "grouped": 0, "stock": 0}


def test_packed_takes_the_rows_past_union_and_ahead_of_grouped(layer):
    moe, wrap = wrapped(layer, union=True, packed=True, grouped=True)
    for rows, seed in ((16, 5), (17, 6), (40, 7)):
        check(moe, layer, rows, seed)
    assert wrap.calls == {"union": 1, "packed": 2, "grouped": 0, "stock": 0}
    assert wrap.tables["packed"] is not wrap.tables["union"]            # its own copy of the same tables


def test_falls_back_on_what_it_does_not_implement(layer):
    moe, wrap = wrapped(layer, union=True, grouped=True)
    x, _, _ = routed(10, seed=19)
    moe.activation_fn = "gelu"
    assert moe.forward(x, {}) == "stock"
    moe.activation_fn = "silu"
    other = fakes.linear_exl3(random_linear(HID, INT, 3, "mcg", torch.Generator()))
    moe.gates[0] = SimpleNamespace(inner=other, quant_type="exl3")
    assert moe.forward(x, {}) == "stock"
    assert "gate and up differ" in wrap.unfit["union"] and "mix EXL3 formats" in wrap.unfit["grouped"]


def test_a_failing_kernel_turns_its_path_off(layer, monkeypatch):
    import toolkit.moe.union as un

    moe, wrap = wrapped(layer, union=True, grouped=True)

    def broken(*a, **k):
        raise RuntimeError("ptxas: no such instruction")

    monkeypatch.setattr(un, "union_forward", broken)
    x, _, _ = routed(10, seed=23)
    with pytest.warns(UserWarning, match="union MoE path off"):
        assert moe.forward(x, {}) == "stock"                               # the failing call: exllamav3's own
    assert "ptxas" in wrap.unfit["union"] and torch.is_tensor(moe.forward(x, {}))     # then grouped takes it
    assert moe.forward(x[:4], {}) == "stock"
    assert lever.path_counts([moe], FakeMoE) == {"union": 0, "packed": 0, "grouped": 1, "stock": 2}
