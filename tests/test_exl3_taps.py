"""runtime/exl3_taps.py on CPU against stand-ins for the exllamav3 objects it touches (Model.forward with the
export params, the Embedding module, the LM head's inner weight, the backend's generate_many), the version pin,
and the tap convention: an EXL3 target's prompts equal a transformers target's for the same weights."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from toolkit.core.errors import ToolkitError
from toolkit.exl3 import taps as exl3_taps
from toolkit.runtime.events import Round
from toolkit.exl3.taps import EXPORT_LAYERS, EXPORTED, Exl3Target

V, H, LAYERS = 40, 8, 5


class FakeEmbedding:
    """exllamav3.modules.Embedding's forward: ids [1, n] (CPU) -> float [1, n, H]."""

    def __init__(self, table):
        self.table = table

    def forward(self, ids, params):
        return self.table[ids]


class FakeHead:
    """A Linear whose inner weight is [in, out], padded to the tiles as exllamav3 stores it."""

    def __init__(self, weight):                  # weight [V, H]
        padded = torch.zeros(16, 48, dtype=torch.half)
        padded[:H, :V] = weight.T.half()
        self.device = "cpu"
        self.inner = types.SimpleNamespace(in_features=16, out_features=48, calls=[],
                                           forward=lambda x, params, out_dtype=None: self.forward(x, out_dtype))
        self.padded = padded

    def forward(self, x, out_dtype):             # LinearEXL3.forward: x [rows, in] (fp16) @ W [in, out]
        self.inner.calls.append(tuple(x.shape))
        assert x.dtype == torch.half and x.is_contiguous() and out_dtype == torch.float
        return x.float() @ self.padded.float()


class FakeModel:
    """Model.forward as exllamav3 1.6.5 runs it: every block whose layer_idx is in params['export_state_layers']
    appends its output to params['export_states'], in layer order; the logits are padded past the vocabulary."""

    def __init__(self, skip: int | None = None):
        torch.manual_seed(0)
        self.table = torch.randn(V, H)
        self.head = torch.randn(V, H)
        self.config = types.SimpleNamespace(vocab_size=V, hidden_size=H)
        self.modules = [FakeEmbedding(self.table), FakeHead(self.head)]
        self.logit_layer_idx = 1
        self.skip, self.seen = skip, []

    def output(self, ids, layer):
        return (self.table[ids] * (layer + 1)).half()

    def forward(self, input_ids, params):
        self.seen.append(dict(params))
        for layer in range(LAYERS):
            if layer in params.get(EXPORT_LAYERS, ()) and layer != self.skip:
                params.setdefault(EXPORTED, []).append(self.output(input_ids, layer))
        logits = torch.full((1, input_ids.shape[1], 48), -1e4)
        logits[0, :, :V] = torch.nn.functional.one_hot((input_ids[0] + 1) % V, V).float()
        return logits


class FakeBackend:
    def __init__(self, model):
        self.model, self.calls, self.closed = model, [], False

    def generate_many(self, prompts, settings, speculative=True):
        assert not speculative and settings.temperature == 0.0
        self.calls.append(len(prompts))
        for i, p in enumerate(prompts):
            yield i, Round((), 0, p[-1] + 1, prefill=True)
            yield i, Round((), 0, p[-1] + 2)

    def close(self):
        self.closed = True


@pytest.fixture
def exllamav3_modules(monkeypatch):
    mod = types.ModuleType("exllamav3.modules")
    mod.Embedding = FakeEmbedding
    monkeypatch.setitem(sys.modules, "exllamav3", types.ModuleType("exllamav3"))
    monkeypatch.setitem(sys.modules, "exllamav3.modules", mod)


def test_forward_exports_the_tap_layers_in_layer_order():
    m = FakeModel()
    t = Exl3Target(FakeBackend(m))
    greedy, states = t.forward([3, 1, 4], [4, 1, 2, 1])
    assert m.seen[0]["attn_mode"] == "flash_attn_nc" and m.seen[0][EXPORT_LAYERS] == {1, 2, 4}   # no cache
    assert greedy.tolist() == [4, 2, 5] and greedy.device.type == "cpu"        # argmax within the vocabulary
    assert sorted(states) == [1, 2, 4]
    for L, s in states.items():
        assert s.shape == (1, 3, H) and s.dtype == torch.half and torch.equal(s, m.output(torch.tensor([[3, 1, 4]]), L))


def test_a_missing_export_is_one_line():
    t = Exl3Target(FakeBackend(FakeModel(skip=2)))
    with pytest.raises(ToolkitError, match=r"exported 2 hidden states for the 3 tap layers \[1, 2, 4\].*1\.6\.5") as e:
        t.forward([1, 2], [1, 2, 4])
    assert "\n" not in str(e.value)


def test_continuations_in_batches():
    be = FakeBackend(FakeModel())
    t = Exl3Target(be, batch=2)
    assert t.continue_greedy([[1], [2, 3], [5]], 2) == [[1, 2, 3], [2, 3, 4, 5], [5, 6, 7]]
    assert be.calls == [2, 1]


def test_embedding_table_and_head(exllamav3_modules, monkeypatch):
    monkeypatch.setattr(exl3_taps, "EMBED_CHUNK", 16)          # three lookups of the vocabulary
    m = FakeModel()
    t = Exl3Target(FakeBackend(m))
    table = t.embedding_table()
    assert table.shape == (V, H) and table.dtype == torch.float32 and torch.equal(table, m.table)
    monkeypatch.setattr(exl3_taps, "HEAD_ROWS", 3)              # the head read 3 identity rows at a time
    head = t.head_weight()
    assert head.shape == (V, H) and head.dtype == torch.half and torch.equal(head, m.head.half())
    assert head.is_contiguous() and not head.is_inference()
    assert m.modules[m.logit_layer_idx].inner.calls == [(3, 16), (3, 16), (2, 16)]     # never the whole head at once


def test_close_unloads():
    be = FakeBackend(FakeModel())
    Exl3Target(be).close()
    assert be.closed


def test_needs_exllamav3_installed(monkeypatch):
    from toolkit.exl3 import seams

    monkeypatch.setattr(seams, "version", lambda: None)
    with pytest.raises(ToolkitError, match=r"exllamav3 is not installed.*\[gpu\]"):
        exl3_taps.check_installed()


def test_imports_without_exllamav3_or_cuda():
    code = "import sys, toolkit.exl3.taps, toolkit.quant.engine; print('exllamav3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1], env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    assert out.stdout.strip() == "False"


def test_exl3_prompts_match_the_transformers_target(pair):
    """The tap convention: exllamav3 exports the output of block L + s, transformers' hidden_states[L + s + 1]."""
    from test_quantize_fakes import FakeExl3Target
    from toolkit.dflash import DFlashConfig
    from toolkit.quant.blocks import load_target
    from toolkit.quant.target import exl3_prompts, hf_prompts, tap_layers
    from toolkit.runtime.backend import encode_chat

    target, draft = pair
    config = DFlashConfig.from_dir(draft)
    model, tok = load_target(target)
    ids = [encode_chat(tok, p) for p in ("json.dumps", "csv.reader")]
    assert tap_layers(config, [0, 1]) == [0, 1, 2]
    a = exl3_prompts(FakeExl3Target(target, []), ids, config, [0, 1], 5)
    b = hf_prompts(model, ids, config, [0, 1], 5)
    for x, y in zip(a, b):
        assert torch.equal(x.ids, y.ids) and torch.equal(x.greedy, y.greedy) and x.start == y.start == len(x.ids) - 6
        for s in (0, 1):
            assert x.taps[s].shape == y.taps[s].shape == (1, len(x.ids), 2 * 128)
            assert torch.allclose(x.taps[s], y.taps[s], atol=1e-6)


def fake_fla(monkeypatch) -> tuple[types.ModuleType, list]:
    """exllamav3.vendor.fla with a chunk_gated_delta_rule that records what it was given and returns an output and,
    when asked, a final state (the state plus one, so a dropped or passed-on state shows)."""
    calls: list = []

    def scan(q, k, v, g=None, beta=None, initial_state=None, output_final_state=False, **kw):
        calls.append((None if initial_state is None else initial_state.clone(), output_final_state, kw))
        return q * 2, (initial_state + 1 if output_final_state and initial_state is not None else None)

    from toolkit.exl3.seams import SEAMS

    where = SEAMS["chunk_gated_delta_rule"].path.partition(":")[0]
    fla = types.ModuleType(where)
    fla.chunk_gated_delta_rule = scan
    for name in ("exllamav3", "exllamav3.vendor"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, where, fla)
    return fla, calls


def test_a_no_cache_scan_runs_with_a_zero_state_and_drops_the_state_it_did_not_ask_for(monkeypatch):
    fla, calls = fake_fla(monkeypatch)
    inner = fla.chunk_gated_delta_rule
    q, k, v = torch.ones(1, 5, 2, 4), torch.ones(1, 5, 2, 4), torch.ones(1, 5, 6, 3)     # H 2, K 4; HV 6, V 3
    with exl3_taps.stateful_scan():
        o, state = fla.chunk_gated_delta_rule(q, k, v, g=None, beta=None, use_qk_l2norm_in_kernel=True)
        assert torch.equal(o, q * 2) and state is None
        h0, asked, kw = calls[-1]
        assert h0.shape == (1, 6, 4, 3) and h0.dtype == torch.float32 and not h0.any() and asked is True
        assert kw == {"use_qk_l2norm_in_kernel": True}
        # asked for it: the final state of the zero start comes back
        assert torch.equal(fla.chunk_gated_delta_rule(q, k, v, output_final_state=True)[1], torch.ones(1, 6, 4, 3))
        # a cached prefill's own state passes through untouched
        h = torch.full((1, 6, 4, 3), 3.0)
        assert torch.equal(fla.chunk_gated_delta_rule(q, k, v, initial_state=h, output_final_state=True)[1], h + 1)
        assert calls[-1][1] is True and torch.equal(calls[-1][0], h)
    assert fla.chunk_gated_delta_rule is inner                         # restored on the way out
    monkeypatch.setattr(exl3_taps, "STATEFUL_SCAN", False)             # the switch off: exllamav3's own call
    with exl3_taps.stateful_scan():
        assert fla.chunk_gated_delta_rule is inner


def test_the_tap_forward_runs_inside_the_stateful_scan(monkeypatch):
    fla, _ = fake_fla(monkeypatch)
    inner = fla.chunk_gated_delta_rule
    seen = []
    model = FakeModel()
    forward = model.forward
    model.forward = lambda ids, params: seen.append(fla.chunk_gated_delta_rule is not inner) or forward(ids, params)
    t = Exl3Target(types.SimpleNamespace(model=model))
    t.forward([1, 2, 3], [0, 2])
    assert seen == [True] and fla.chunk_gated_delta_rule is inner
