"""The union MoE path (toolkit/moe/union*.py) on the CPU: its Triton kernels under TRITON_INTERPRET=1 and exllamav3's
multi-matrix GEMM by a torch reference (moe_fakes.RefMgemm), against the float64 reference of the layer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import moe_fakes as fakes  # noqa: E402
from moe_fakes import EXPERTS, HID, INT, TOPK, FORMATS, RefMgemm, assert_close, routed  # noqa: E402
from toolkit.moe import union as un  # noqa: E402
from toolkit.moe.ref import random_layer, random_linear, ref_moe  # noqa: E402
from toolkit.moe.weights import MoeLayer  # noqa: E402

KERNELS = "toolkit.moe.union_kernels"


interpreted = fakes.interpreted_fixture(KERNELS)


@pytest.fixture(scope="module")
def layer():
    return random_layer(HID, INT, EXPERTS, 4, "mcg", seed=3)


def run(layer, x, sel, w):
    t = un.build_tables(layer, torch.device("cpu"))
    mg = RefMgemm(t.keep)
    return un.union_forward(x, sel, w, t, mg, un.Workspace()), mg, t


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 40])
def test_union_lists_each_touched_expert_once(interpreted, rows, shared):
    E = 16
    g = torch.Generator().manual_seed(rows)
    sel = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(rows)])
    u = min(rows * 3, E) + shared
    ub = un.next_pow2(u)
    mark, n = torch.zeros(E, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    idx_gu, idx_d = torch.full((1, 2 * u), 99, dtype=torch.int64), torch.full((1, u), 99, dtype=torch.int64)
    slot_of = torch.zeros(rows * 3, dtype=torch.int32)
    interpreted.union_kernel[(1,)](sel, mark, idx_gu, idx_d, slot_of, n, rows * 3, E=E, SHARED=int(shared), UMAX=u,
                                   PB=un.next_pow2(rows * 3), EB=E, UB=ub)
    distinct = sorted(set(sel.flatten().tolist()))
    want = ([E] if shared else []) + distinct
    assert int(n) == len(want)
    assert idx_d[0].tolist() == want + [-1] * (u - len(want))
    ups = [e + E + shared if e < E else 2 * E + 1 for e in want]
    assert idx_gu[0, 0::2].tolist() == idx_d[0].tolist() and idx_gu[0, 1::2].tolist() == ups + [-1] * (u - len(want))
    assert [want[s] for s in slot_of.tolist()] == sel.flatten().tolist()


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_forward_matches_reference(layer, rows):
    x, sel, w = routed(rows, seed=rows)
    out, mg, t = run(layer, x, sel, w)
    assert out.shape == (rows, HID) and out.dtype == torch.float32 and t.shared
    assert_close(out, ref_moe(x, sel, w, layer))
    distinct = len(set(sel.flatten().tolist()))
    assert mg.calls == [2 * (distinct + 1), distinct + 1]        # each touched expert once per GEMM, + the shared


def test_every_expert_touched_and_repeats(layer):
    x, _, w = routed(12, seed=5)
    sel = torch.tensor([[0, 1]] * 6 + [[e, (e + 1) % EXPERTS] for e in range(6)])
    out, _, _ = run(layer, x, sel, w)
    assert_close(out, ref_moe(x, sel, w, layer))


@pytest.mark.parametrize("codebook,K,shared,gated", FORMATS)
def test_other_formats_and_shared_experts(codebook, K, shared, gated):
    lay = random_layer(HID, INT, EXPERTS, K, codebook, seed=7, shared=shared, gated_shared=gated)
    x, sel, w = routed(6, seed=8)
    out, _, t = run(lay, x, sel, w)
    assert t.shared == shared
    assert_close(out, ref_moe(x, sel, w, lay))


def test_a_shared_expert_of_another_format_is_left_out(layer):
    g = torch.Generator().manual_seed(9)
    other = tuple(random_linear(a, b, 3, "mcg", g) for a, b in ((HID, INT), (HID, INT), (INT, HID)))
    lay = MoeLayer(layer.gates, layer.ups, layer.downs, other, layer.shared_gate)
    x, sel, w = routed(4, seed=10)
    out, _, t = run(lay, x, sel, w)
    assert not t.shared
    assert_close(out, ref_moe(x, sel, w, MoeLayer(layer.gates, layer.ups, layer.downs)))


def test_what_cannot_share_the_gemms_is_refused(layer):
    g = torch.Generator().manual_seed(11)
    ups = [random_linear(HID, INT, 3, "mcg", g)] + layer.ups[1:]
    with pytest.raises(ValueError, match="gate and up differ"):
        un.build_tables(MoeLayer(layer.gates, ups, layer.downs), torch.device("cpu"))
    ups = layer.ups[:-1] + [random_linear(HID, INT, 3, "mcg", g)]
    with pytest.raises(ValueError, match="mix EXL3 formats"):
        un.build_tables(MoeLayer(layer.gates, ups, layer.downs), torch.device("cpu"))
    with pytest.raises(ValueError, match="rows"):
        x, sel, w = routed(1, seed=1)
        t = un.build_tables(layer, torch.device("cpu"))
        un.union_forward(x.repeat(65, 1), sel.repeat(65, 1), w.repeat(65, 1), t, RefMgemm(t.keep))


def test_workspace_grows_and_is_reused():
    ws = un.Workspace()
    a = ws.get("a", (2, 3), torch.float16, torch.device("cpu"))
    b = ws.get("a", (1, 3), torch.float16, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr()
    c = ws.get("a", (4, 4), torch.float16, torch.device("cpu"))
    assert c.shape == (4, 4) and ws.get("a", (2, 3), torch.float16, torch.device("cpu")).data_ptr() == c.data_ptr()


def test_graphs_run_eagerly_then_capture_then_replay():
    import contextlib

    from toolkit.moe.graphs import Graphed

    recorded = []

    class FakeGraph:
        """Records the forward it sees while capturing; replay runs it again (a CUDA graph replays kernels)."""

        def replay(self):
            self.fn()

    @contextlib.contextmanager
    def capture(graph):
        recorded.append(graph)
        yield

    def forward(x, sel, w, out=None):
        y = x.float() * w.float().sum()
        if out is None:
            return y
        out.copy_(y)
        if recorded and not hasattr(recorded[-1], "fn"):             # the capture: replay repeats this write
            recorded[-1].fn = lambda: out.copy_(x.float() * w.float().sum())
        return out

    g = Graphed(forward, capture, FakeGraph)
    x, sel, w = routed(3, seed=1)
    assert torch.equal(g(x, sel, w), forward(x, sel, w)) and not recorded       # first call: eager
    out = g(x * 2, sel, w)                                                        # second: captured, then replayed
    assert len(recorded) == 1 and torch.equal(out, (x * 2).float() * w.float().sum())
    static = g.graphs[next(iter(g.graphs))][2]
    again = g(x * 3, sel, w)                                                      # later: replayed, inputs copied in
    assert torch.equal(again, (x * 3).float() * w.float().sum()) and again.data_ptr() != static.data_ptr()
    assert len(recorded) == 1
    g(x[:2], sel[:2], w[:2])                                                      # a new shape: eager again
    assert len(recorded) == 1
