"""The whole-forward graphs (toolkit/exl3/graphs.py) on a CPU stand-in of exllamav3's layer walk.

The stand-in graph re-runs the captured function on the static inputs at every replay and copies the result into
the tensors the capture returned, which is what a CUDA graph's replay amounts to: it checks that every changing
input reaches the static buffers, that host records and tapped states come back as the eager forward leaves them,
and that the shapes the graphs refuse run eagerly.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from toolkit.exl3 import graphs as G


def copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        assert len(dst) == len(src)
        for d, s in zip(dst, src):
            copy_into(d, s)
    elif isinstance(dst, dict):
        for k in dst:
            copy_into(dst[k], src[k])


class FakeGraph:
    captures = 0

    def replay(self):
        copy_into(self.out, self.fn())


def fake_capture(graph, fn, pool):
    FakeGraph.captures += 1
    graph.fn = fn
    graph.out = fn()
    return graph.out


def to_device(params, key, device):
    return params[key].to(device)


class LayerState:
    """exllamav3's recurrent layer state keeps the shape of the last speculative pass for its rewind."""

    def __init__(self):
        self.spec_shape = None


class Module:
    """What every stand-in module shares with exllamav3's: caps, a device, and inputs already where they belong."""

    caps: dict = {}
    device = "cpu"

    def prepare_for_device(self, x, params):
        return x


class Embedding(Module):
    caps = {"prefer_cpu": True}

    def __init__(self, table):
        self.table = table

    def forward(self, x, params):
        params.setdefault("input_ids", x)
        return self.table[x]


class Layer(Module):
    def __init__(self, idx, cache, state):
        self.idx, self.cache, self.state = idx, cache, state

    def forward(self, x, params):
        seqlens = params["cache_seqlens"]
        pages = params["block_table"]
        slots = params.get("recurrent_slots")
        bsz, n, _ = x.shape
        for b in range(bsz):                               # a K/V write at the job's positions
            pos = int(seqlens[b]) + torch.arange(n)
            self.cache[self.idx, pages[b, 0], pos] = x[b, :, 0]
        y = x + 0.01 * seqlens.view(-1, 1, 1).float() + 0.1 * self.idx
        if slots is not None:
            y = y + slots.view(-1, 1, 1).float()
        if params.get("recurrent_history"):
            self.state.spec_shape = (bsz, n, 1)
        if self.idx in params.get("export_state_layers", ()):
            s = params.get("export_states")
            if not s:
                s = params["export_states"] = []
            s.append(y.clone())
        return y


class Head(Module):
    caps = {"logits_output": True}

    def __init__(self, w):
        self.w = w

    def forward(self, x, params):
        return x @ self.w


class FakeModel:
    def __init__(self, layers=3, vocab=11, hidden=4):
        g = torch.Generator().manual_seed(0)
        self.cache = torch.zeros(layers, 40, 64)
        self.state = LayerState()
        mods = [Embedding(torch.randn(vocab, hidden, generator=g))]
        mods += [Layer(i, self.cache, self.state) for i in range(layers)]
        mods += [Head(torch.randn(hidden, vocab, generator=g))]
        self.modules = mods
        self.fwd_modules = [(m, 0, i) for i, m in enumerate(mods)]

    def forward_ls(self, x, params):
        for module, instance, _ in self.fwd_modules:
            params["layer_instance"] = instance
            x = module.forward(module.prepare_for_device(x, params), params)
        return x

    def forward(self, ids, params):                       # exllamav3's Model.forward calls forward_ls
        return self.forward_ls(ids, params)


def call_params(seqlens, pages=None, history=False, slots=None, exports=()):
    seqlens = torch.tensor(seqlens, dtype=torch.int32)
    p = {"attn_mode": "flash_attn", "cache_seqlens": seqlens, "positions": seqlens,
         "block_table": pages if pages is not None else torch.arange(len(seqlens), dtype=torch.int32).view(-1, 1),
         "recurrent_history": history, "export_state_layers": set(exports)}
    if slots is not None:
        p["recurrent_slots"] = torch.tensor(slots, dtype=torch.int32)
    return p


def graphed(model):
    return G.ForwardGraphs(model, to_device, states=lambda p: [model.state], capture=fake_capture,
                           new_graph=FakeGraph).install()


def test_replays_equal_the_eager_forward_with_inputs_that_change_every_call():
    eager, model = FakeModel(), FakeModel()
    fg = graphed(model)
    assert fg.head == 1                                   # the CPU embedding runs eagerly, before the graph
    for step in range(8):
        ids = torch.tensor([[step % 11, (step + 3) % 11], [(2 * step) % 11, 5]])
        args = dict(seqlens=[step * 2, 10 + step], history=True, slots=[step % 3, 1], exports=(0, 2))
        pe, pg = call_params(**args), call_params(**args)
        ye, yg = eager.forward(ids, pe), model.forward(ids, pg)
        assert torch.equal(ye, yg), step
        assert len(pg["export_states"]) == 2 and all(torch.equal(a, b) for a, b in zip(pe["export_states"], pg["export_states"]))
        assert model.state.spec_shape == eager.state.spec_shape == (2, 2, 1)
        assert torch.equal(model.cache, eager.cache)
    assert fg.calls == {"replayed": 8 - G.WARM - 1, "captured": 1, "eager": G.WARM}
    assert fg.report()["shapes"] == 1 and fg.report()["memory_mib"] == 0.0      # no CUDA pool on the CPU


def test_a_replay_hands_back_copies_the_next_replay_cannot_overwrite():
    model = FakeModel()
    graphed(model)
    outs = []
    for step in range(G.WARM + 3):
        p = call_params([step, step + 1], exports=(1,))
        outs.append((model.forward(torch.tensor([[1], [2]]), p), p["export_states"][0]))
    a, b = outs[-2], outs[-1]
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    assert a[0].data_ptr() != b[0].data_ptr()


def test_host_records_are_set_on_replay_as_the_eager_forward_sets_them():
    model = FakeModel()
    graphed(model)
    for step in range(G.WARM + 2):
        model.forward(torch.tensor([[1, 2, 3]]), call_params([step], history=True))
    model.state.spec_shape = None                        # a rewind clears nothing here; a replay must set it again
    model.forward(torch.tensor([[1, 2, 3]]), call_params([9], history=True))
    assert model.state.spec_shape == (1, 3, 1)


def test_each_shape_gets_its_own_graph():
    model = FakeModel()
    fg = graphed(model)
    for width in (1, 4, 1, 4, 1, 4, 1, 4):
        model.forward(torch.ones(1, width, dtype=torch.long), call_params([5]))
    assert fg.report()["shapes"] == 2 and fg.calls["replayed"] == 2


@pytest.mark.parametrize("why, make", [
    ("prefill", lambda: (torch.ones(1, G.MAX_TOKENS + 1, dtype=torch.long), call_params([0]))),
    ("jobs", lambda: (torch.ones(G.MAX_JOBS + 1, 1, dtype=torch.long), call_params([0] * (G.MAX_JOBS + 1)))),
    ("batch_shape", lambda: (torch.ones(1, 1, dtype=torch.long), {**call_params([0]), "batch_shape": (1, 256)})),
    ("object", lambda: (torch.ones(1, 1, dtype=torch.long), {**call_params([0]), "mystery": object()})),
])
def test_calls_the_graphs_do_not_take_run_eagerly_and_say_why_once(why, make, caplog):
    eager, model = FakeModel(), FakeModel()
    fg = graphed(model)
    with caplog.at_level(logging.WARNING, logger=G.__name__):
        for _ in range(G.WARM + 3):
            x, p = make()
            x2, p2 = make()
            assert torch.equal(model.forward(x, p), eager.forward(x2, p2))
    assert fg.calls["replayed"] == 0 and fg.calls["eager"] == G.WARM + 3
    assert len([r for r in caplog.records if "forward graphs" in r.message]) == 1


def test_a_capture_that_fails_leaves_every_later_call_eager_with_one_line(caplog):
    def broken(graph, fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    model = FakeModel()
    fg = G.ForwardGraphs(model, to_device, capture=broken, new_graph=FakeGraph).install()
    eager = FakeModel()
    with caplog.at_level(logging.WARNING, logger=G.__name__):
        for step in range(G.WARM + 4):
            for ids in (torch.tensor([[3]]), torch.tensor([[3, 4]])):          # a second shape is not tried
                assert torch.equal(model.forward(ids, call_params([step])), eager.forward(ids, call_params([step])))
    assert fg.calls["replayed"] == 0 and fg.calls["captured"] == 0
    lines = [r.message for r in caplog.records if "forward graphs" in r.message]
    assert len(lines) == 1 and "a capture failed (RuntimeError: operation not permitted" in lines[0]
    assert "test_forward_graphs.py:" in lines[0]                                # where it failed


def test_uninstall_restores_exllamav3s_own_walk():
    model = FakeModel()
    fg = graphed(model)
    assert "forward_ls" in vars(model)
    fg.uninstall()
    assert "forward_ls" not in vars(model)


def test_shape_key_keeps_scalars_and_shapes_and_refuses_unknown_objects():
    x = torch.ones(2, 3, dtype=torch.long)
    k1 = G.shape_key(x, call_params([1, 2]))
    assert k1 == G.shape_key(x, call_params([7, 9]))        # values change, the shape does not
    assert k1 != G.shape_key(x, call_params([1, 2], history=True))
    wide = call_params([1, 2], pages=torch.zeros(2, 16, dtype=torch.int32))
    assert k1 != G.shape_key(x, wide)                       # a wider block table is another graph
    assert isinstance(G.shape_key(x, {**call_params([1, 2]), "thing": object()}), str)
    why = G.shape_key(x, {**call_params([1, 2]), "draft_embedding": torch.zeros(2, 3, 4)})
    assert why == "the call passes draft_embedding"          # a refused parameter may be a tensor
    assert not isinstance(G.shape_key(x, {**call_params([1, 2]), "indexed_embeddings": []}), str)


class GDNState:
    pass


def test_only_recurrent_states_that_reach_kernels_through_tensors_are_captured():
    x = torch.ones(1, 2, dtype=torch.long)
    assert not isinstance(G.shape_key(x, {**call_params([1]), "recurrent_states": [GDNState()]}), str)
    why = G.shape_key(x, {**call_params([1]), "recurrent_states": [SWAState()]})
    assert isinstance(why, str) and "SWAState" in why


class Window(Module):
    """A sliding-window layer as exllamav3 runs one: its ring positions are prepared on the host every step."""

    def __init__(self, ring):
        self.ring = ring                                   # [slots, S]
        self.preps = 0

    def _decode_state_prep(self, rsg, k_states, v_states, seqlen):
        self.preps += 1
        lens = []
        for rs in rsg:
            pos = rs.position
            if pos + seqlen > k_states.shape[1]:             # the rare shift of a full ring
                k_states[rs.slot].roll(-4)
                rs.wshift, pos = 4, pos - 4
            lens.append(pos)
        return torch.tensor([[rs.slot] for rs in rsg], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)

    def forward(self, x, params):
        rsg = params["recurrent_states"]
        bt, lens = self._decode_state_prep(rsg, self.ring, self.ring, x.shape[1])
        return x + lens.view(-1, 1, 1).float() + bt.view(-1, 1, 1).float() * 0.5


class SWAState:
    """A drafter's window state: its ring position is read on the host."""

    def __init__(self, slot=0, position=0):
        self.slot, self.position, self.wshift = slot, position, 0


def test_a_drafters_window_layers_are_prepared_on_the_host_before_every_replay():
    from toolkit.exl3.window_graphs import WindowPreps

    def drafter():
        m = FakeModel(layers=1)
        win = Window(torch.zeros(4, 30))
        m.fwd_modules.insert(2, (win, 0, 9))
        return m, win

    (eager, _), (model, _) = drafter(), drafter()
    fg = G.ForwardGraphs(model, to_device, capture=fake_capture, new_graph=FakeGraph,
                         windows=lambda mods: WindowPreps(mods, lambda m: isinstance(m, Window)) or None).install()
    assert fg.windows is not None and len(fg.windows) == 1
    for step in range(G.WARM + 4):
        pos = [3 * step, 1 + step]
        pe = {**call_params(pos), "recurrent_states": [SWAState(1, pos[0]), SWAState(2, pos[1])]}
        pg = {**call_params(pos), "recurrent_states": [SWAState(1, pos[0]), SWAState(2, pos[1])]}
        ids = torch.tensor([[1, 2], [3, 4]])
        assert torch.equal(eager.forward(ids, pe), model.forward(ids, pg)), step
    assert fg.calls["replayed"] == 3
    no_windows = G.ForwardGraphs(FakeModel(), to_device, capture=fake_capture, new_graph=FakeGraph)
    assert isinstance(G.shape_key(ids, pg, no_windows.safe_states), str)     # without the preparations: eager


class Block(Module):
    """exllamav3's transformer block: the window layer sits inside it, and iterating the block yields it."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        yield self
        yield self.inner

    def forward(self, x, params):
        return self.inner.forward(x, params)


def test_window_layers_inside_blocks_are_found():
    from toolkit.exl3.window_graphs import WindowPreps

    m = FakeModel(layers=1)
    m.fwd_modules.insert(2, (Block(Window(torch.zeros(4, 30))), 0, 9))
    fg = G.ForwardGraphs(m, to_device, capture=fake_capture, new_graph=FakeGraph,
                         windows=lambda mods: WindowPreps(mods, lambda x: isinstance(x, Window)) or None)
    assert fg.windows is not None and len(fg.windows) == 1


@pytest.mark.parametrize("wanted, env, loaded, expect", [
    (True, None, False, "0"),          # wanted, nothing set, no load yet: exllamav3's own graphs go off
    (False, None, False, None),        # not wanted: exllamav3 keeps its graphs
    (True, "1", False, "1"),           # the user's setting stands (the captures then stay eager, one line says why)
    (True, None, True, None),          # too late: an earlier load settled the process
])
def test_the_first_load_turns_exllamav3s_own_graphs_off_only_when_whole_forward_graphs_are_wanted(
        monkeypatch, wanted, env, loaded, expect):
    from toolkit.exl3 import loading

    monkeypatch.setattr(loading, "FIRST_LOAD", {"EXL3_GRAPHS": None} if loaded else {})
    if env is None:
        monkeypatch.delenv("EXL3_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("EXL3_GRAPHS", env)
    loading.settle_graphs_mode(wanted)
    assert os.environ.get("EXL3_GRAPHS") == expect
    assert (loading.exl3_graphs_blocker() is None) == (expect == "0" and not loaded)
