"""The drafter's adopted lever (toolkit/exl3/draft_levers.py): the causal flag around causal sliding-window layers,
how the backend installs and removes it, and lever parsing."""

from __future__ import annotations

import pytest
import torch
from exl3_fakes import FakeModel, make_backend

from toolkit.core.errors import ToolkitError
from toolkit.exl3.draft_levers import CausalWindowForward, set_draft_levers, set_graph_draft_swa
from toolkit.exl3.options import ADOPTED, Exl3Options, parse_lever


class FakeSWA:
    """A sliding-window layer that records the causal flag each call saw; `fail` raises inside the call."""

    def __init__(self, window_right=0, sliding_window=4095, fail=False):
        self.window_right, self.sliding_window, self.fail, self.seen = window_right, sliding_window, fail, []

    def forward(self, x, params, out_dtype=None):
        self.seen.append(params.get("causal"))
        if self.fail:
            raise RuntimeError("kernel failed")
        return x + 1


def decode_params(**kw):
    return {"attn_mode": "flash_attn", "causal": False, **kw}


def test_causal_window_layers_see_the_causal_flag_and_the_block_keeps_its_own():
    m = FakeSWA()
    assert set_graph_draft_swa([m, FakeSWA(window_right=4095), object()], FakeSWA, True) == 2
    assert isinstance(vars(m)["forward"], CausalWindowForward)
    p = decode_params()
    assert torch.equal(m.forward(torch.zeros(2), p), torch.ones(2))
    assert m.seen == [True] and p["causal"] is False           # the full layer after it still reads False


@pytest.mark.parametrize("layer, params", [
    (FakeSWA(window_right=4095), decode_params()),                          # bidirectional in the block
    (FakeSWA(sliding_window=-1), decode_params()),                          # no window: not a sliding layer
    (FakeSWA(), decode_params(causal=True)),                                # exllamav3 graphs it already
    (FakeSWA(), decode_params(attn_mode="flash_attn_nc")),                  # not the cached decode path
    (FakeSWA(), decode_params(non_causal_spans=[(0, 4, True)])),            # spans carry their own direction
])
def test_other_calls_are_left_alone(layer, params):
    set_graph_draft_swa([layer], FakeSWA, True)
    before = params.get("causal")
    layer.forward(torch.zeros(1), params)
    assert layer.seen == [before] and params.get("causal") == before


def test_the_flag_comes_back_when_the_layer_fails_and_the_wrap_comes_off():
    m = FakeSWA(fail=True)
    set_graph_draft_swa([m], FakeSWA, True)
    p = decode_params()
    with pytest.raises(RuntimeError, match="kernel failed"):
        m.forward(torch.zeros(1), p)
    assert p["causal"] is False
    set_graph_draft_swa([m], FakeSWA, False)
    assert "forward" not in vars(m)


def test_backend_installs_and_removes_the_drafter_lever(monkeypatch, tmp_path):
    be = make_backend(monkeypatch, tmp_path)
    swa = FakeSWA()
    be.engine.draft, be.draft_classes = FakeModel([swa, object()]), (FakeSWA,)
    be.set_options(Exl3Options(graph_draft_swa=True))
    assert isinstance(vars(swa)["forward"], CausalWindowForward)
    be.set_options(Exl3Options())
    assert "forward" not in vars(swa)


def test_no_exllamav3_import_when_the_lever_is_off():
    set_draft_levers(FakeModel([FakeSWA()]), Exl3Options(), Exl3Options())   # CPU: no exllamav3


def test_levers_parse_on_and_off():
    assert parse_lever("graph_draft_swa") == ("graph_draft_swa", Exl3Options(graph_draft_swa=True))
    with pytest.raises(ToolkitError, match="unknown lever 'bogus'"):
        parse_lever("graph_draft_swa+bogus")
    assert parse_lever("graph_draft_swa=off", ADOPTED) == ("graph_draft_swa=off", Exl3Options(grouped_moe=True, union_moe=True))
    with pytest.raises(ToolkitError, match="lever graph_draft_swa: bad value 'maybe'"):
        parse_lever("graph_draft_swa=maybe")


def test_the_backend_defaults_to_the_adopted_levers(monkeypatch, tmp_path):
    be = make_backend(monkeypatch, tmp_path)
    assert be.options == ADOPTED and ADOPTED.graph_draft_swa and ADOPTED.tag == "graph_draft_swa,grouped_moe,union_moe"
    assert make_backend(monkeypatch, tmp_path, options=Exl3Options()).options.tag == "stock"
