"""What the whole-forward graphs (toolkit/exl3/graphs.py) leave eager and what a replay sets on the host, on the
CPU stand-in of exllamav3's layer walk (tests/test_forward_graphs.py)."""

from __future__ import annotations

import logging

import torch

from tests.test_forward_graphs import FakeGraph, FakeModel, LayerState, call_params, fake_capture, to_device
from toolkit.exl3 import graphs as G


def test_a_shape_the_caller_refuses_stays_eager_and_others_are_captured(caplog):
    model, eager = FakeModel(), FakeModel()
    fg = G.ForwardGraphs(model, to_device, capture=fake_capture, new_graph=FakeGraph,
                         refuse=lambda x, params: "two tokens sync" if x.shape[1] == 2 else None).install()
    with caplog.at_level(logging.WARNING, logger=G.__name__):
        for step in range(G.WARM + 3):
            for ids in (torch.tensor([[3]]), torch.tensor([[3, 4]])):
                assert torch.equal(model.forward(ids, call_params([step])), eager.forward(ids, call_params([step])))
    assert fg.report()["shapes"] == 1 and fg.calls["replayed"] == 2
    assert [r.message for r in caplog.records if "forward graphs" in r.message] == \
        ["forward graphs: two tokens sync; those calls run eagerly"]


def test_a_record_the_forward_writes_with_its_old_value_is_still_set_on_replay():
    """A pass of one job after a pass of two: the layer state must say one job, though at capture the one-job
    shape wrote the value it already held."""
    class HostlessGraph(FakeGraph):               # a real replay runs no Python: the forward's host writes are undone
        def replay(self):
            kept = vars(model.state).copy()
            super().replay()
            vars(model.state).update(kept)

    eager, model = FakeModel(), FakeModel()
    G.ForwardGraphs(model, to_device, states=lambda p: [model.state], capture=fake_capture,
                    new_graph=HostlessGraph).install()
    one, two = torch.tensor([[3, 4]]), torch.tensor([[3, 4], [5, 6]])
    for step in range(G.WARM + 1):                          # the one-job shape warms up and is captured
        args = dict(seqlens=[step * 2], history=True, slots=[0])
        model.forward(one, call_params(**args))
        eager.forward(one, call_params(**args))
    for step in range(3):
        args2 = dict(seqlens=[20 + step, 30], history=True, slots=[0, 1])
        model.forward(two, call_params(**args2))
        args1 = dict(seqlens=[40 + step], history=True, slots=[0])
        assert torch.equal(model.forward(one, call_params(**args1)), eager.forward(one, call_params(**args1)))
        assert model.state.spec_shape == (1, 2, 1)
    assert type(model.state) is LayerState                  # the class comes back after the capture


def test_rows_an_moe_layer_would_sync_at_are_refused_and_rows_its_paths_take_are_not(monkeypatch):
    from toolkit.exl3 import moe as M

    class MoE:
        pass

    wrapped, bare = MoE(), MoE()
    wrapped.forward = M.MoeForward.__new__(M.MoeForward)
    monkeypatch.setattr(M.MoeForward, "pick", lambda self, rows, params: "union" if rows <= 16 else "stock")
    ids = lambda jobs, tokens: torch.zeros(jobs, tokens, dtype=torch.long)
    refuse = M.capture_refusal([wrapped], MoE)
    assert refuse(ids(2, 8), {}) is None and refuse(ids(1, 16), {}) is None
    assert refuse(ids(2, 16), {}) == "32 rows take exllamav3's own MoE forward, which syncs with the host"
    refuse = M.capture_refusal([wrapped, bare], MoE)                       # a layer without the wrap
    assert refuse(ids(8, 1), {}) is None and "9 rows" in refuse(ids(9, 1), {})
