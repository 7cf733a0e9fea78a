"""toolkit.synthetic (synthetic EXL3 checkpoints) and its reference trellis decoder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from toolkit.core.errors import ToolkitError, run_cli
from toolkit.synthetic import build_plan, codebook_table, decode_linear, synth
from toolkit.synth import main as synth_main
from toolkit.synthetic.codebook import MUL1_BIAS, MUL1_K_INV, pack_tiles, tensor_core_perm, tile_states
from toolkit.synthetic.tokenizer import build_tokenizer, specials_for

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "quantize" / "shapes"
CODEBOOK_SCALE = 1.24371088          # exllamav3 quantize.py: the std of its 3INST codebook


def tiny_target() -> dict:
    """A Qwen3.5/3.6-MoE config in the hub layout, scaled down (hidden 128, 3 linear + 1 full attention layers)."""
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": {
        "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "max_position_embeddings": 4096}}


def tiny_drafter() -> dict:
    d = json.loads((SHAPES / "qwen3.6-35b-a3b-dflash.json").read_text())
    d.update(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=64, vocab_size=512,
             num_target_layers=4)
    d["dflash_config"] = {"block_size": 16, "mask_token_id": 500, "target_layer_ids": [0, 1, 2]}
    return d


def write(tmp: Path, name: str, cfg: dict) -> Path:
    p = tmp / f"{name}.json"
    p.write_text(json.dumps(cfg))
    return p


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("synth")
    res = synth(str(write(tmp, "t", tiny_target())), 4, str(tmp / "t4"), quiet=True)
    return tmp / "t4", res


# -- the reference decoder --------------------------------------------------------------------------


def test_codebooks_match_exllamav3_constants():
    inst = codebook_table("3inst").double()
    assert abs(inst.std().item() - CODEBOOK_SCALE) < 2e-4 and abs(inst.mean().item()) < 0.01
    mul1 = codebook_table("mul1").double()
    assert abs(mul1.mean().item()) < 0.01 and abs(mul1.std().item() - 1.0) < 0.01     # a byte sum, normalised
    assert abs(1 / MUL1_K_INV - 147.7) < 0.2 and abs(MUL1_BIAS + 1534 * MUL1_K_INV) < 0.01
    assert sorted(tensor_core_perm().tolist()) == list(range(256))


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6, 8])
def test_trellis_states_are_a_sliding_window_over_the_packed_symbols(K):
    g = torch.Generator().manual_seed(K)
    sym = torch.randint(0, 1 << K, (2, 3, 256), generator=g)
    packed = pack_tiles(sym, K)                      # exllamav3's pack_trellis algorithm
    assert packed.shape == (2, 3, 16 * K) and packed.dtype == torch.int16
    st = tile_states(packed, K)                      # exllamav3's dequant indexing
    assert torch.equal(st & ((1 << K) - 1), sym)
    assert torch.equal(st >> K, torch.roll(st, 1, -1) & ((1 << (16 - K)) - 1))   # tail-biting shift register


def test_decoded_weights_have_the_requested_scale():
    g = torch.Generator().manual_seed(0)
    tr = torch.randint(-32768, 32768, (16, 16, 64), dtype=torch.int16, generator=g)
    signs = lambda n: (torch.randint(0, 2, (n,), generator=g) * 2 - 1).half()     # noqa: E731
    w = decode_linear(tr, signs(256) * 0.03, signs(256))
    assert w.shape == (256, 256) and abs(w.mean().item()) < 0.001 and abs(w.std().item() / 0.03 - 1) < 0.03


# -- checkpoints ------------------------------------------------------------------------------------


def test_target_layout(target):
    folder, res = target
    t = tensors(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["num_hidden_layers"] == 4
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and "text_config" not in cfg
    q = cfg["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "version", "bits", "head_bits", "codebook", "out_scales")} == \
        {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6, "codebook": "mul1", "out_scales": "auto"}
    p = "model.language_model.layers"
    expect = {
        f"{p}.0.linear_attn.in_proj_qkv.trellis": ((8, 16, 64), torch.int16),   # 128 -> 2*64 + 2*64
        f"{p}.0.linear_attn.in_proj_qkv.suh": ((128,), torch.float16),
        f"{p}.0.linear_attn.in_proj_qkv.svh": ((256,), torch.float16),
        f"{p}.0.linear_attn.in_proj_qkv.mul1": ((), torch.int32),
        f"{p}.0.linear_attn.in_proj_z.trellis": ((8, 8, 64), torch.int16),
        f"{p}.0.linear_attn.out_proj.trellis": ((8, 8, 64), torch.int16),
        f"{p}.0.linear_attn.in_proj_b.weight": ((2, 128), torch.float16),
        f"{p}.0.linear_attn.in_proj_a.weight": ((2, 128), torch.float16),
        f"{p}.0.linear_attn.A_log": ((2,), torch.bfloat16),
        f"{p}.0.linear_attn.dt_bias": ((2,), torch.bfloat16),
        f"{p}.0.linear_attn.conv1d.weight": ((256, 1, 4), torch.bfloat16),
        f"{p}.0.linear_attn.norm.weight": ((64,), torch.bfloat16),
        f"{p}.3.self_attn.q_proj.trellis": ((8, 16, 64), torch.int16),           # query + gate, 2 heads x 64
        f"{p}.3.self_attn.k_proj.trellis": ((8, 8, 64), torch.int16),            # 64 wide, padded to 128
        f"{p}.3.self_attn.k_proj.svh": ((128,), torch.float16),
        f"{p}.3.self_attn.o_proj.trellis": ((8, 8, 64), torch.int16),
        f"{p}.3.self_attn.q_norm.weight": ((64,), torch.bfloat16),
        f"{p}.2.mlp.gate.weight": ((4, 128), torch.float16),
        f"{p}.2.mlp.experts.3.down_proj.trellis": ((8, 8, 64), torch.int16),
        f"{p}.2.mlp.shared_expert.up_proj.trellis": ((8, 8, 64), torch.int16),
        f"{p}.2.mlp.shared_expert_gate.weight": ((1, 128), torch.float16),
        "model.language_model.embed_tokens.weight": ((512, 128), torch.bfloat16),
        "model.language_model.norm.weight": ((128,), torch.bfloat16),
        "lm_head.trellis": ((8, 32, 96), torch.int16),                             # head at 6 bits
    }
    for name, (shape, dtype) in expect.items():
        assert tuple(t[name].shape) == shape and t[name].dtype == dtype, name
    assert set(t) == {s.name for s in build_plan(tiny_target(), 4).tensors} and len(t) == res["tensors"]
    assert t["lm_head.mul1"].item() & 0xFFFFFFFF == 0x83DCD12D
    assert t[f"{p}.3.self_attn.k_proj.svh"][64:].abs().sum() == 0                  # padded columns are off
    assert torch.all(t[f"{p}.0.input_layernorm.weight"] == 0)                     # Qwen3.5 stores (scale - 1)
    assert torch.all(t[f"{p}.0.linear_attn.norm.weight"] == 1)
    assert not any(k.startswith("model.layers.") or ".experts.gate_up_proj" in k for k in t)


def test_target_decodes_to_realistic_weights(target):
    folder, res = target
    assert len(res["decoded_check"]) == 4
    for d in res["decoded_check"]:
        assert abs(d["std"] / 0.02 - 1) < 0.1 and abs(d["mean"]) < 0.002
    t = tensors(folder)
    key = "model.language_model.layers.1.mlp.experts.0.gate_proj"
    w = decode_linear(t[f"{key}.trellis"], t[f"{key}.suh"], t[f"{key}.svh"])
    assert abs(w.std().item() / 0.02 - 1) < 0.05 and abs(w.mean().item()) < 0.001


def test_tokenizer_has_the_vocab_size(target):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder, _ = target
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size() == 512 and tok.token_to_id("<|im_end|>") == specials_for(512).im_end
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert len(hf) == 512 and hf.eos_token == "<|im_end|>"
    assert hf.decode(hf("def f(x): return x")["input_ids"]) == "def f(x): return x"
    full = build_tokenizer(248320)                   # the Qwen3.6 vocabulary size, specials where Qwen puts them
    assert full.get_vocab_size() == 248320 and full.token_to_id("<|endoftext|>") == 248044
    assert full.token_to_id("<|im_end|>") == 248046 and full.id_to_token(248077) == "<|special_248077|>"


def test_drafter_layout(tmp_path):
    from toolkit.dflash import DFlashConfig

    res = synth(str(write(tmp_path, "d", tiny_drafter())), 6, str(tmp_path / "d6"), quiet=True)
    t = tensors(tmp_path / "d6")
    assert tuple(t["fc.trellis"].shape) == (24, 8, 96) and tuple(t["fc.suh"].shape) == (384,)     # 3 taps x 128
    assert tuple(t["layers.1.self_attn.k_proj.trellis"].shape) == (8, 8, 96)
    assert tuple(t["layers.0.mlp.down_proj.trellis"].shape) == (16, 8, 96)
    assert torch.all(t["hidden_norm.weight"] == 1) and torch.all(t["layers.0.self_attn.k_norm.weight"] == 1)
    assert not any("embed" in k or "lm_head" in k for k in t) and res["kind"] == "dflash" and res["head_bits"] is None
    cfg = json.loads((tmp_path / "d6" / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == 6.0 and "_source" not in cfg and not (tmp_path / "d6" / "tokenizer.json").exists()
    assert DFlashConfig.from_dir(tmp_path / "d6").block_size == 16


def test_shards_and_index(tmp_path):
    synth(str(write(tmp_path, "t", tiny_target())), 2, str(tmp_path / "s"), shard_gb=100e3 / 1024**3, quiet=True)
    files = sorted((tmp_path / "s").glob("*.safetensors"))
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05}.safetensors"
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    got = tensors(tmp_path / "s")
    assert set(index["weight_map"]) == set(got) and index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in got.values())


def test_real_shapes_plan():
    target = build_plan(json.loads((SHAPES / "qwen3.6-35b-a3b.json").read_text()), 4)
    assert target.config["num_experts"] == 256 and target.config["vocab_size"] == 248320
    assert len(target.linears) == 40 * (256 * 3 + 3) + 30 * 3 + 10 * 4 + 1         # experts+shared, GDN, attention, head
    assert 17.0e9 < target.nbytes < 19.5e9
    draft = build_plan(json.loads((SHAPES / "qwen3.6-35b-a3b-dflash.json").read_text()), 6)
    assert len(draft.linears) == 1 + 6 * 7 and 0.25e9 < draft.nbytes < 0.35e9


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    from toolkit.synthetic import build

    calls = {"n": 0}
    real = build.Filler.__call__

    def flaky(self, t):
        calls["n"] += 1
        if calls["n"] == 50:
            raise RuntimeError("disk on fire")
        return real(self, t)

    monkeypatch.setattr(build.Filler, "__call__", flaky)
    cfg = write(tmp_path, "t", tiny_target())
    with pytest.raises(RuntimeError, match="disk on fire"):
        synth(str(cfg), 4, str(tmp_path / "out" / "t4"), quiet=True)
    assert not (tmp_path / "out" / "t4").exists() and list((tmp_path / "out").iterdir()) == []


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    cfg = write(tmp_path, "t", tiny_target())
    out = tmp_path / "t4"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ToolkitError, match="not empty"):
        synth(str(cfg), 4, str(out), quiet=True)
    synth(str(cfg), 3, str(out), overwrite=True, quiet=True)
    assert not (out / "keep.txt").exists() and json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t4"]


@pytest.mark.parametrize("argv, message", [
    (["--config", "missing.json", "--bits", "4"], "no such file"),
    (["--config", "{t}", "--bits", "1.5"], "--bits must be an integer from 1 to 8"),
    (["--config", "{t}", "--bits", "9"], "--bits must be an integer from 1 to 8"),
    (["--config", "{t}", "--bits", "4", "--head-bits", "12"], "--head-bits must be an integer"),
    (["--config", "{llama}", "--bits", "4"], "model_type 'llama'"),
    (["--config", "{bad}", "--bits", "4"], "not valid JSON"),
    (["--config", "{nokey}", "--bits", "4"], "missing key 'num_experts'"),
])
def test_one_line_errors(tmp_path, capsys, argv, message):
    t = write(tmp_path, "t", tiny_target())
    llama = write(tmp_path, "llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    (tmp_path / "bad.json").write_text("{")
    nokey = tiny_target()
    del nokey["text_config"]["num_experts"]
    paths = {"t": t, "llama": llama, "bad": tmp_path / "bad.json", "nokey": write(tmp_path, "nokey", nokey)}
    argv = [a.format(**paths) for a in argv] + ["--out", str(tmp_path / "o"), "--quiet"]
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: synth_main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "o").exists()


def test_cli_exit_code_and_summary(tmp_path):
    cfg = write(tmp_path, "d", tiny_drafter())
    bad = subprocess.run([sys.executable, "-m", "toolkit.synth", "--config", str(cfg), "--bits", "9", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and bad.stderr.startswith("error: --bits")
    ok = subprocess.run([sys.executable, "-m", "toolkit.synth", "--config", str(cfg), "--bits", "4", "--out", str(tmp_path / "d4"),
                         "--quiet"], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["kind"] == "dflash" and summary["shards"] == 1 and summary["device"] in ("cpu", "cuda")


def test_skewed_routing_scales_router_rows_and_narrows_the_experts_a_window_touches(tmp_path):
    from toolkit.synthetic.build import ROUTER_SKEW

    cfg = tiny_target()
    cfg["text_config"].update(num_experts=256, num_experts_per_tok=8, num_hidden_layers=1, layer_types=["linear_attention"])
    res = synth(str(write(tmp_path, "t", cfg)), 2, str(tmp_path / "s"), quiet=True, routing="skewed", shard_gb=0.5)
    assert res["routing"] == "skewed"
    cfg_out = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg_out["quantization_config"]["synthetic"]["routing"] == "skewed"
    gate = next(v for k, v in tensors(tmp_path / "s").items() if k.endswith(".mlp.gate.weight")).float()
    spread = gate.norm(dim=1).log().std().item()
    assert abs(spread - ROUTER_SKEW) < 0.15, spread          # per-expert scales of log-std ROUTER_SKEW
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 15, gate.shape[1], generator=g)     # isotropic router inputs, windows of 15 tokens
    top = (x @ gate.T).topk(8, -1).indices
    skewed = sum(t.unique().numel() for t in top.view(400, -1)) / 400
    assert 45 < skewed < 70                                  # random routing touches 97 of 256 in 15 tokens


# -- the MTP head ------------------------------------------------------------------------------------

# What exllamav3 1.6.5 loads for a Qwen3.5-MoE MTP head, read from its source: architecture/qwen3_5_mtp.py
# (Qwen3_5MTPModel with use_moe, the Qwen3_5MoeMTPModel of Qwen3_5VLMoeConfig) and
# modules/arch_specific/qwen3_5_mtp.py (Qwen3_5MTPInputLayer). Per module key: "norm" = an RMSNorm (`.weight`),
# "linear" = a quantized Linear with its (in, out) features, "fp16" = the router / shared-expert gate the
# converter keeps unquantized. {i} = layer, {e} = expert; H hidden, Q = 2 x heads x head_dim (query + gate),
# KV = kv heads x head_dim, O = heads x head_dim, I / S = expert / shared-expert intermediate, E experts.
EXL3_MTP_MODULES = [
    ("mtp.pre_fc_norm_hidden", "norm", "H"), ("mtp.pre_fc_norm_embedding", "norm", "H"),
    ("mtp.fc", "linear", ("2H", "H")),
    ("mtp.layers.{i}.input_layernorm", "norm", "H"), ("mtp.layers.{i}.post_attention_layernorm", "norm", "H"),
    ("mtp.layers.{i}.self_attn.q_proj", "linear", ("H", "Q")), ("mtp.layers.{i}.self_attn.k_proj", "linear", ("H", "KV")),
    ("mtp.layers.{i}.self_attn.v_proj", "linear", ("H", "KV")), ("mtp.layers.{i}.self_attn.o_proj", "linear", ("O", "H")),
    ("mtp.layers.{i}.self_attn.q_norm", "norm", "D"), ("mtp.layers.{i}.self_attn.k_norm", "norm", "D"),
    ("mtp.layers.{i}.mlp.gate", "fp16", ("H", "E")),
    ("mtp.layers.{i}.mlp.experts.{e}.up_proj", "linear", ("H", "I")),
    ("mtp.layers.{i}.mlp.experts.{e}.gate_proj", "linear", ("H", "I")),
    ("mtp.layers.{i}.mlp.experts.{e}.down_proj", "linear", ("I", "H")),
    ("mtp.layers.{i}.mlp.shared_expert.up_proj", "linear", ("H", "S")),
    ("mtp.layers.{i}.mlp.shared_expert.gate_proj", "linear", ("H", "S")),
    ("mtp.layers.{i}.mlp.shared_expert.down_proj", "linear", ("S", "H")),
    ("mtp.layers.{i}.mlp.shared_expert_gate", "fp16", ("H", "1")),
    ("mtp.norm", "norm", "H"),
]
VISION_KEYS = ("deepstack_visual_indexes", "depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads",
               "num_position_embeddings", "out_hidden_size", "patch_size", "spatial_merge_size", "temporal_patch_size",
               "model_type")                     # exllamav3 architecture/qwen3_vl.py read_qwen3_vl_vision_config
PREPROCESSOR_KEYS = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                     "image_processor_type")     # read_qwen3_vl_pp_config, which wants Qwen2VLImageProcessorFast


def mtp_shape(cfg: dict) -> dict:
    """`cfg` with the MTP head and the multimodal keys the hub config carries (from the real MTP shape file)."""
    real = json.loads((SHAPES / "qwen3.6-35b-a3b-mtp.json").read_text())
    return {**cfg, "text_config": {**cfg["text_config"], "mtp_num_hidden_layers": 1},
            "vision_config": real["vision_config"], "_preprocessor_config": real["_preprocessor_config"]}


def expected_mtp(t: dict, bits: int) -> dict[str, tuple[int, ...]]:
    """EXL3_MTP_MODULES as tensor names and shapes for a text config `t`, its linears at `bits` (padded to 128
    except mtp.fc, which exllamav3 builds with pad_to 1)."""
    H, hd, nq, nkv = t["hidden_size"], t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    dims = {"H": H, "2H": 2 * H, "D": hd, "Q": 2 * nq * hd, "KV": nkv * hd, "O": nq * hd, "E": t["num_experts"],
            "I": t["moe_intermediate_size"], "S": t["shared_expert_intermediate_size"], "1": 1}
    out = {}
    for key, kind, size in EXL3_MTP_MODULES:
        for i in range(t["mtp_num_hidden_layers"]):
            for e in range(t["num_experts"] if "{e}" in key else 1):
                k = key.format(i=i, e=e)
                if kind == "norm":
                    out[f"{k}.weight"] = (dims[size],)
                elif kind == "fp16":
                    out[f"{k}.weight"] = (dims[size[1]], dims[size[0]])
                else:
                    n_in, n_out = (dims[s] if k == "mtp.fc" else -(-dims[s] // 128) * 128 for s in size)
                    out.update({f"{k}.trellis": (n_in // 16, n_out // 16, 16 * bits), f"{k}.suh": (n_in,),
                                f"{k}.svh": (n_out,), f"{k}.mul1": ()})
    return out


def test_an_mtp_shape_writes_the_head_exllamav3_loads(tmp_path):
    cfg = mtp_shape(tiny_target())
    res = synth(str(write(tmp_path, "m", cfg)), 4, str(tmp_path / "m4"), mtp_bits=3, quiet=True)
    folder = tmp_path / "m4"
    got = {k: tuple(v.shape) for k, v in tensors(folder).items()}
    text = {**cfg["text_config"], "mtp_num_hidden_layers": 1}
    assert {k: s for k, s in got.items() if k.startswith("mtp.")} == expected_mtp(text, 3)
    plain = {s.name: s.shape for s in build_plan(tiny_target(), 4).tensors}
    assert {k: s for k, s in got.items() if not k.startswith("mtp.")} == plain        # the trunk as without the head
    out = json.loads((folder / "config.json").read_text())
    assert out["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and out["model_type"] == "qwen3_5_moe"
    assert out["text_config"]["mtp_num_hidden_layers"] == 1 and "architectures" not in out["text_config"]
    assert set(VISION_KEYS) <= set(out["vision_config"]) and out["vision_config"]["deepstack_visual_indexes"] == []
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    assert set(PREPROCESSOR_KEYS) <= set(pre) and pre["image_processor_type"] == "Qwen2VLImageProcessorFast"
    assert out["quantization_config"]["mtp_bits"] == 3 and res["mtp_bits"] == 3 and "_preprocessor_config" not in out
    from toolkit.mtp import read_mtp

    assert read_mtp(folder).experts == 4                                               # --draft mtp takes it


def test_the_plain_shape_is_written_as_before_and_an_mtp_shape_needs_its_multimodal_keys(tmp_path):
    plain = build_plan(json.loads((SHAPES / "qwen3.6-35b-a3b.json").read_text()), 4)
    assert plain.config["architectures"] == ["Qwen3_5MoeForCausalLM"] and not plain.files
    assert not any(t.name.startswith("mtp.") for t in plain.tensors)
    real = build_plan(json.loads((SHAPES / "qwen3.6-35b-a3b-mtp.json").read_text()), 4)
    trunk = [t for t in real.tensors if not t.name.startswith("mtp.")]
    assert [(t.name, t.shape) for t in trunk] == [(t.name, t.shape) for t in plain.tensors]
    head = sum(t.nbytes for t in real.tensors if t.name.startswith("mtp."))
    assert 0.40e9 < head < 0.45e9 and set(real.files) == {"preprocessor_config.json"}   # 256 experts at 4 bits
    bare = tiny_target()
    bare["text_config"]["mtp_num_hidden_layers"] = 1
    with pytest.raises(ToolkitError, match="needs its vision_config"):
        build_plan(bare, 4)
    with pytest.raises(ToolkitError, match="needs its _preprocessor_config"):
        build_plan({**mtp_shape(tiny_target()), "_preprocessor_config": None}, 4)
