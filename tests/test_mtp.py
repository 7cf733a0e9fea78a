"""`--draft mtp` on the torch backend: the reference MTP head against transformers' own Qwen3.5-MoE decoder layer,
its K/V bookkeeping against a recompute from scratch, greedy output equal to AR with the same Round contract as
DFlash, and a target without an MTP head refused in one line (CLI and library)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from stream_shape import assert_stream_shape

from toolkit.core.errors import ToolkitError
from toolkit.mtp import DEPTH, MTP, MtpShape, hf_tensors, read_mtp
from toolkit.mtp.head import MtpCache, MtpHead
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of
from toolkit.runtime.factory import load_backend

PROMPT = "Return a new list of the items"


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    from toolkit.assets.fixtures import build

    return build(tmp_path_factory.mktemp("mtp"), arch="qwen3_5_moe", mtp=True)[0]


@pytest.fixture(scope="module")
def mtp_backend(mtp_target):
    return load_backend("torch", str(mtp_target), MTP)


def test_the_head_layer_is_transformers_qwen3_5_moe_decoder_layer():
    """Same weights, same outputs: a block at once and the same rows one by one through the head's cache."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, layer_types=["full_attention"], num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=48, vocab_size=100,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
    cfg._attn_implementation = "eager"
    ref = M.Qwen3_5MoeDecoderLayer(cfg, 0)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head = MtpHead(MtpShape.of({**cfg.to_dict(), "mtp_num_hidden_layers": 1}))
    ours = {"mlp.experts.gate_up_proj": None, "mlp.experts.down_proj": None}
    state = {f"layers.0.{k}": v for k, v in ref.state_dict().items() if k not in ours}
    gate_up = ref.state_dict()["mlp.experts.gate_up_proj"]
    state.update({"layers.0.mlp.w_gate": gate_up[:, :32], "layers.0.mlp.w_up": gate_up[:, 32:],
                  "layers.0.mlp.w_down": ref.state_dict()["mlp.experts.down_proj"]})
    missing = head.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["fc.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"]
    n = 7
    x = torch.randn(1, n, 64)
    pe = M.Qwen3_5MoeTextRotaryEmbedding(cfg)(x, torch.arange(n)[None, None].expand(3, 1, n))
    want = ref(x, position_embeddings=pe, attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None])[0]
    freqs = torch.arange(n).float()[:, None] * head.inv_freq[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    with torch.no_grad():
        whole = head.layers[0](x[0], cos, sin, MtpCache(1), 0)
        cache = MtpCache(1)
        parts = [head.layers[0](x[0, :4], cos[:4], sin[:4], cache, 0)]
        parts += [head.layers[0](x[0, i:i + 1], cos[i:i + 1], sin[i:i + 1], cache, 0) for i in range(4, n)]
    assert torch.allclose(whole, want, atol=1e-5) and torch.allclose(torch.cat(parts), want, atol=1e-4)


def test_fixture_carries_the_head_exllamav3_and_transformers_layouts_expect(mtp_target):
    shape = read_mtp(mtp_target)
    assert shape.layers == 1 and shape.experts == 4 and shape.rotary_factor == 0.25
    from toolkit.core.tensorfiles import tensor_shapes

    have = {k: s for k, (_, s) in tensor_shapes(mtp_target / "model.safetensors").items() if k.startswith("mtp.")}
    assert have == hf_tensors(shape)


def reference_drafts(target, head: MtpHead, seq: list[int], width: int) -> list[int]:
    """The drafts after `seq` (its last token not yet verified), recomputed from scratch: the target over seq[:-1],
    the head's rows over all of seq from the target's final states, then `width` steps."""
    with torch.no_grad():
        h = target(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        emb, lm = target.get_input_embeddings(), target.get_output_embeddings()
        cache = MtpCache(head.shape.layers)
        out = head(emb(torch.tensor(seq)), torch.cat((torch.zeros_like(h[:1]), h)), cache)[-1:]
        drafts = []
        for _ in range(width):
            drafts.append(int(lm(out)[0].argmax()))
            out = head(emb(torch.tensor(drafts[-1:])), out, cache)
    return drafts


def test_the_heads_rows_follow_the_accepted_tokens_whatever_each_round_kept(mtp_backend, monkeypatch):
    """Rounds of every kind (nothing kept, part, all, plain AR rounds in a row, a backlog written early) leave the
    head's cache as a recompute from the accepted tokens alone would: the same drafts."""
    monkeypatch.setattr("toolkit.runtime.torch_mtp.BACKLOG_MAX", 3)
    be = mtp_backend
    prompt = be.tokenizer.encode(PROMPT)
    ar = tokens_of(be.generate(prompt, GenSettings(max_new_tokens=40), speculative=False))
    steps = be.steps(True)
    steps.prefill(prompt)
    emitted, junk = 1, (ar[0] + 1) % 500
    for width, kept in [(4, 0), (4, 2), (0, 0), (0, 0), (0, 0), (0, 0), (3, 3), (1, 0), (4, 4), (2, 1)]:
        token = ar[emitted - 1]
        if width:
            assert steps.draft_block(token, width) == reference_drafts(be.target, be.head, prompt + ar[:emitted], width)
        block = [token] + ar[emitted:emitted + kept] + [junk] * (width - kept)
        picks = steps.verify(block).argmax(-1).tolist()
        assert picks[kept] == ar[emitted + kept]
        steps.accept(kept + 1)
        emitted += kept + 1
    assert steps.draft_block(ar[emitted - 1], 4) == reference_drafts(be.target, be.head, prompt + ar[:emitted], 4)


@pytest.mark.parametrize("block", [2, DEPTH + 1, 16])
def test_greedy_mtp_equals_ar_and_its_rounds_keep_the_contract(mtp_backend, block):
    be = mtp_backend
    ids = be.tokenizer.encode(PROMPT)
    spec = list(be.generate(ids, GenSettings(max_new_tokens=24, block_size=block)))
    ar = list(be.generate(ids, GenSettings(max_new_tokens=24), speculative=False))
    assert be.block_size == DEPTH + 1 and tokens_of(spec) == tokens_of(ar)
    assert_stream_shape(spec, width=min(block, DEPTH + 1) - 1, max_new_tokens=24)


def test_auto_policy_on_mtp_is_lossless(mtp_backend, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_COST_CACHE", str(tmp_path))
    be = mtp_backend
    ids = be.tokenizer.encode(PROMPT)
    spec = list(be.generate(ids, GenSettings(max_new_tokens=24)))
    assert tokens_of(spec) == tokens_of(be.generate(ids, GenSettings(max_new_tokens=24), speculative=False))
    assert any(r.drafted for r in spec) and all(len(r.drafted) <= DEPTH for r in spec)


def test_generate_json_with_draft_mtp(mtp_target):
    r = subprocess.run([sys.executable, "-m", "toolkit.generate", "--target", str(mtp_target), "--draft", MTP,
                        "--prompt", "hi", "--compare-ar", "--json", "--max-new-tokens", "8", "--block-size", "3",
                        "--reps", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["lossless"] and res["block_size"] == 3 and all(len(x["drafted"]) == 2 for x in res["rounds"][1:])


def test_a_target_without_a_head_is_one_line(pair, tmp_path):
    r = subprocess.run([sys.executable, "-m", "toolkit.generate", "--target", str(pair[0]), "--draft", MTP, "--prompt",
                        "hi"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: --draft mtp:") and "no MTP head" in r.stderr and "mtp_num_hidden_layers" in r.stderr
    with pytest.raises(ToolkitError, match="carries no MTP head"):
        load_backend("torch", str(pair[0]), MTP)


def test_a_head_missing_tensors_is_refused_before_the_target_loads(mtp_target, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(mtp_target, bad)
    t = load_file(str(bad / "model.safetensors"))
    del t["mtp.layers.0.self_attn.k_norm.weight"]
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr("toolkit.runtime.torch_mtp.load_hf_model", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ToolkitError, match="lacks MTP tensor 'mtp.layers.0.self_attn.k_norm.weight'"):
        load_backend("torch", str(bad), MTP)
    for name in [k for k in t if k.startswith("mtp.")]:
        del t[name]
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ToolkitError, match="holds no mtp.. tensors"):
        load_backend("torch", str(bad), MTP)


def test_eval_tau_with_mtp_needs_held_out_prompts(mtp_target):
    from toolkit.eval_tau import EvalTauOptions, eval_tau

    with pytest.raises(ToolkitError, match="give --heldout FILE or --heldout unseen"):
        eval_tau(EvalTauOptions(str(mtp_target), MTP))
    with pytest.raises(ToolkitError, match="no card to write"):
        eval_tau(EvalTauOptions(str(mtp_target), MTP, heldout="unseen", write_card=True))


def test_the_app_loads_the_target_with_its_mtp_head(mtp_target, tmp_path, monkeypatch):
    from toolkit.app.models import Hardware, ModelSpec, load

    monkeypatch.setenv("DFLASH_COST_CACHE", str(tmp_path))
    monkeypatch.setattr("toolkit.app.models.fetch_model", lambda ref, what: (ref, ref) if what == "target" else
                        pytest.fail("fetched the drafter"))
    out = load(ModelSpec(str(mtp_target), MTP, backend="torch"), Hardware())
    assert out.error is None and out.draft == "the target's own MTP head" and out.block_size == DEPTH + 1
