"""Which tensors an EXL3 checkpoint of a given HF config holds, as exllamav3 1.6.5's converter writes them.

Quantized linears (`qmap` set in exllamav3's module tree) become `<key>.trellis` int16 [in/16, out/16, 16*K],
`<key>.suh` fp16 [in], `<key>.svh` fp16 [out] (dims padded to 128) and a codebook marker `<key>.mul1` (or
`.mcg`) int32 scalar. Unquantized linears (router gate, shared-expert gate, Gated DeltaNet b/a) stay
`<key>.weight` fp16 [out, in]; norms, embeddings and Gated DeltaNet parameters keep the checkpoint's bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.errors import ToolkitError
from ..core.files import Num, number
from ..core.target import TargetInfo
from ..mtp.config import LAYERS_KEY as MTP_LAYERS
from .codebook import marker_value

PAD = 128
ITEMSIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.int16: 2, torch.int32: 4}
QWEN35_ARCHS = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
QWEN35_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
DFLASH_ARCH = "DFlashDraftModel"
KINDS = ("qwen3_5_moe", "dflash")
# transformers 5.24 Qwen3_5MoeTextConfig defaults for the keys a hub config may leave out
QWEN35_DEFAULTS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=32, shared_expert_intermediate_size=512, rms_norm_eps=1e-6, head_dim=None,
                       full_attention_interval=4, max_position_embeddings=32768, tie_word_embeddings=False)
QWEN35_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                   "num_experts", "num_experts_per_tok", "moe_intermediate_size")

COUNT = Num(1, 1024, whole=True)          # layers, heads, experts, kernel widths of any real config
SIZES = {k: Num(1, 1 << 21, whole=True) for k in ("hidden_size", "vocab_size", "moe_intermediate_size",
                                                  "shared_expert_intermediate_size", "max_position_embeddings")}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, shape, dtype and how to fill it (`fill` with parameter `value`)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str            # trellis | suh | svh | marker | normal | router | const | a_log
    value: float = 0.0   # std (normal, suh), constant (const, marker), real width (svh: columns past it are 0)

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass
class Plan:
    """A checkpoint to synthesise: config.json (without quantization_config) and tensors grouped by module."""

    kind: str
    config: dict
    groups: list[list[TensorSpec]] = field(default_factory=list)
    vocab_size: int | None = None
    linears: list[str] = field(default_factory=list)     # keys of the quantized linears, in write order
    files: dict[str, dict] = field(default_factory=dict)  # other JSON files of the folder (name -> content)

    @property
    def tensors(self) -> list[TensorSpec]:
        return [t for g in self.groups for t in g]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def pad(n: int) -> int:
    return -(-n // PAD) * PAD


class _Builder:
    def __init__(self, plan: Plan, bits: int, head_bits: int, codebook: str, std: float):
        self.plan, self.bits, self.head_bits, self.codebook, self.std = plan, bits, head_bits, codebook, std
        self.group: list[TensorSpec] = []

    def flush(self) -> None:
        if self.group:
            self.plan.groups.append(self.group)
            self.group = []

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: str, value: float = 0.0) -> None:
        self.group.append(TensorSpec(name, tuple(int(s) for s in shape), dtype, fill, float(value)))

    def linear(self, key: str, n_in: int, n_out: int, bits: int | None = None, pad_dims: bool = True) -> None:
        """A linear of y = x @ W, W (n_in, n_out): EXL3 at `bits` (the decoder's by default), fp16 at 16."""
        K = self.bits if bits is None else bits
        if K == 16:
            self.add(f"{key}.weight", (n_out, n_in), torch.float16, "normal", self.std)
            return
        k, n = (pad(n_in), pad(n_out)) if pad_dims else (n_in, n_out)
        if k % PAD or n % PAD:
            raise ToolkitError(f"{key}: EXL3 needs both dims to be multiples of {PAD}, got {n_in} x {n_out}")
        self.add(f"{key}.trellis", (k // 16, n // 16, 16 * K), torch.int16, "trellis")
        self.add(f"{key}.suh", (k,), torch.float16, "suh", self.std)
        self.add(f"{key}.svh", (n,), torch.float16, "svh", n_out)
        marker = marker_value(self.codebook)
        if marker is not None:
            self.add(f"{key}.{self.codebook}", (), torch.int32, "marker", marker)
        self.plan.linears.append(key)

    def fp16(self, key: str, n_in: int, n_out: int) -> None:
        self.add(f"{key}.weight", (n_out, n_in), torch.float16, "normal", self.std)

    def norm(self, key: str, n: int, value: float) -> None:
        self.add(f"{key}.weight", (n,), torch.bfloat16, "const", value)


def _need(cfg: dict, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ToolkitError(f"{what}: missing key {missing[0]!r}")


def kind_of(cfg: dict) -> str:
    """'qwen3_5_moe' or 'dflash' for a config dict; a one-line error for anything else."""
    archs = TargetInfo(cfg).architectures                 # a list of names, else one line
    if DFLASH_ARCH in archs:
        return "dflash"
    if cfg.get("model_type") in QWEN35_TYPES or any(a in QWEN35_ARCHS for a in archs):
        return "qwen3_5_moe"
    raise ToolkitError(f"model_type {cfg.get('model_type')!r} (architectures {archs}) is not supported: "
                       f"synth writes qwen3_5_moe targets and {DFLASH_ARCH} drafters")


def qwen35_text(cfg: dict) -> dict:
    """The flat text config of a Qwen3.5/3.6-MoE config (hub multimodal layout or text-only), defaults filled."""
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    t = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **inner}
    for k, v in QWEN35_DEFAULTS.items():
        t.setdefault(k, v)
    _need(t, QWEN35_REQUIRED, "qwen3_5_moe config")
    for k in (*QWEN35_REQUIRED, *(k for k, v in QWEN35_DEFAULTS.items() if isinstance(v, int) and not isinstance(v, bool))):
        number(t[k], SIZES.get(k, COUNT), "qwen3_5_moe config", k)     # in range: the plan's loops and sizes stay finite
    n = int(t["num_hidden_layers"])
    if not t.get("layer_types"):
        every = int(t["full_attention_interval"])
        t["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    types = t["layer_types"]
    if not isinstance(types, list) or len(types) != n or any(x not in ("full_attention", "linear_attention") for x in types):
        raise ToolkitError(f"layer_types must list {n} entries of full_attention / linear_attention")
    if not t.get("head_dim"):
        t["head_dim"] = int(t["hidden_size"]) // int(t["num_attention_heads"])
    number(t["head_dim"], COUNT, "qwen3_5_moe config", "head_dim")
    if t.get("tie_word_embeddings"):
        raise ToolkitError("tie_word_embeddings is true: synth writes an untied lm_head (exllamav3's converter unties it)")
    return t


def qwen35_plan(cfg: dict, bits: int, head_bits: int, codebook: str, std: float, mtp_bits: int = 4) -> Plan:
    """exllamav3's Qwen3_5MoeForCausalLM layout: tensors under model.language_model., a flat text config. A shape
    with an MTP head (`mtp_num_hidden_layers` >= 1) is written in the multimodal layout exllamav3 drafts with it
    from, Qwen3_5MoeForConditionalGeneration (its text_config and vision_config, the preprocessor_config.json its
    config reader opens; no vision tower: text decoding never loads it), with the head's tensors under `mtp.`."""
    t = qwen35_text(cfg)
    out = {k: v for k, v in t.items() if not k.startswith("_") and k not in ("architectures", "full_attention_interval")}
    out.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", tie_word_embeddings=False)
    mtp = int(number(t.get(MTP_LAYERS) or 0, Num(0, 16, whole=True), "qwen3_5_moe config", MTP_LAYERS))
    if mtp:
        out = multimodal_config(cfg, out)
    plan = Plan("qwen3_5_moe", out, vocab_size=int(t["vocab_size"]))
    if mtp:
        plan.files["preprocessor_config.json"] = preprocessor_config(cfg)
    b = _Builder(plan, bits, head_bits, codebook, std)
    H, V = int(t["hidden_size"]), int(t["vocab_size"])
    lk, lv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
    dk, dv, conv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"]), int(t["linear_conv_kernel_dim"])
    p = "model.language_model"
    b.add(f"{p}.embed_tokens.weight", (V, H), torch.bfloat16, "normal", std)
    b.flush()
    for i, kind in enumerate(t["layer_types"]):
        L = f"{p}.layers.{i}"
        b.norm(f"{L}.input_layernorm", H, 0.0)          # Qwen3.5 norms are stored as (scale - 1)
        b.norm(f"{L}.post_attention_layernorm", H, 0.0)
        if kind == "linear_attention":
            a = f"{L}.linear_attn"
            qkv = 2 * lk * dk + lv * dv
            b.linear(f"{a}.in_proj_qkv", H, qkv)
            b.linear(f"{a}.in_proj_z", H, lv * dv)
            b.fp16(f"{a}.in_proj_b", H, lv)
            b.fp16(f"{a}.in_proj_a", H, lv)
            b.linear(f"{a}.out_proj", lv * dv, H)
            b.norm(f"{a}.norm", dv, 1.0)                 # the gated norm is stored as the scale itself
            b.add(f"{a}.A_log", (lv,), torch.bfloat16, "a_log")
            b.add(f"{a}.dt_bias", (lv,), torch.bfloat16, "const", 1.0)
            b.add(f"{a}.conv1d.weight", (qkv, 1, conv), torch.bfloat16, "normal", 0.3)
        else:
            attention(b, f"{L}.self_attn", t)
        moe(b, f"{L}.mlp", t)
        b.flush()
    b.norm(f"{p}.norm", H, 0.0)
    b.flush()
    b.linear("lm_head", H, V, bits=head_bits)
    b.flush()
    if mtp:                                          # exllamav3's Qwen3_5MoeMTPModel: its key names, at mtp_bits
        b.norm("mtp.pre_fc_norm_embedding", H, 0.0)
        b.norm("mtp.pre_fc_norm_hidden", H, 0.0)
        b.linear("mtp.fc", 2 * H, H, bits=mtp_bits, pad_dims=False)
        b.flush()
        for i in range(mtp):
            L = f"mtp.layers.{i}"
            b.norm(f"{L}.input_layernorm", H, 0.0)
            b.norm(f"{L}.post_attention_layernorm", H, 0.0)
            attention(b, f"{L}.self_attn", t, mtp_bits)
            moe(b, f"{L}.mlp", t, mtp_bits)
            b.flush()
        b.norm("mtp.norm", H, 0.0)
        b.flush()
    return plan


def attention(b: _Builder, a: str, t: dict, bits: int | None = None) -> None:
    """A full-attention layer's tensors: q_proj carries the query and the output gate, interleaved per head."""
    H, hd = int(t["hidden_size"]), int(t["head_dim"])
    nq, nkv = int(t["num_attention_heads"]), int(t["num_key_value_heads"])
    b.linear(f"{a}.q_proj", H, 2 * nq * hd, bits)
    b.linear(f"{a}.k_proj", H, nkv * hd, bits)
    b.linear(f"{a}.v_proj", H, nkv * hd, bits)
    b.linear(f"{a}.o_proj", nq * hd, H, bits)
    b.norm(f"{a}.q_norm", hd, 0.0)
    b.norm(f"{a}.k_norm", hd, 0.0)


def moe(b: _Builder, m: str, t: dict, bits: int | None = None) -> None:
    """A sparse MoE block's tensors: the router, each expert as the converter writes it, the gated shared expert."""
    H, E = int(t["hidden_size"]), int(t["num_experts"])
    inter, shared = int(t["moe_intermediate_size"]), int(t["shared_expert_intermediate_size"])
    b.fp16(f"{m}.gate", H, E)
    for e in range(E):
        b.linear(f"{m}.experts.{e}.gate_proj", H, inter, bits)
        b.linear(f"{m}.experts.{e}.up_proj", H, inter, bits)
        b.linear(f"{m}.experts.{e}.down_proj", inter, H, bits)
    b.linear(f"{m}.shared_expert.gate_proj", H, shared, bits)
    b.linear(f"{m}.shared_expert.up_proj", H, shared, bits)
    b.linear(f"{m}.shared_expert.down_proj", shared, H, bits)
    b.fp16(f"{m}.shared_expert_gate", H, 1)


def multimodal_config(cfg: dict, text: dict) -> dict:
    """The hub layout around a flat text config: architectures, the shape's top-level keys, text_config and its
    vision_config (which exllamav3's config reader needs, though no vision tensor is written)."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise ToolkitError(f"a shape with {MTP_LAYERS} needs its vision_config: exllamav3 drafts with the MTP head only "
                           "in the multimodal layout (Qwen3_5MoeForConditionalGeneration), whose config reader reads it")
    top = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("text_config", "vision_config")}
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    text = {k: v for k, v in text.items() if k != "architectures" and (k in inner or k not in top or not inner)}
    return {**top, "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": text, "vision_config": vision}


def preprocessor_config(cfg: dict) -> dict:
    """The preprocessor_config.json of a multimodal shape: its `_preprocessor_config` key."""
    pre = cfg.get("_preprocessor_config")
    if not isinstance(pre, dict):
        raise ToolkitError(f"a shape with {MTP_LAYERS} needs its _preprocessor_config (the model's "
                           "preprocessor_config.json, which exllamav3's config reader opens for the multimodal layout)")
    return pre


def dflash_plan(cfg: dict, bits: int, codebook: str, std: float) -> Plan:
    """exllamav3's DFlashDraftModel layout: fc over the concatenated taps, hidden_norm, layers, norm; no head."""
    from ..dflash import DFlashConfig

    d = DFlashConfig.from_dict(cfg)
    out = {k: v for k, v in cfg.items() if not k.startswith("_")}
    plan = Plan("dflash", out, vocab_size=d.vocab_size)
    b = _Builder(plan, bits, bits, codebook, std)
    H, I, hd = d.hidden_size, d.intermediate_size, d.head_dim
    b.linear("fc", H * len(d.target_layer_ids), H, pad_dims=False)
    b.norm("hidden_norm", H, 1.0)
    b.flush()
    for i in range(d.num_hidden_layers):
        L = f"layers.{i}"
        b.norm(f"{L}.input_layernorm", H, 1.0)
        b.norm(f"{L}.post_attention_layernorm", H, 1.0)
        b.linear(f"{L}.self_attn.q_proj", H, d.num_attention_heads * hd)
        b.linear(f"{L}.self_attn.k_proj", H, d.num_key_value_heads * hd)
        b.linear(f"{L}.self_attn.v_proj", H, d.num_key_value_heads * hd)
        b.linear(f"{L}.self_attn.o_proj", d.num_attention_heads * hd, H)
        b.norm(f"{L}.self_attn.q_norm", hd, 1.0)
        b.norm(f"{L}.self_attn.k_norm", hd, 1.0)
        b.linear(f"{L}.mlp.gate_proj", H, I)
        b.linear(f"{L}.mlp.up_proj", H, I)
        b.linear(f"{L}.mlp.down_proj", I, H)
        b.flush()
    b.norm("norm", H, 1.0)
    b.flush()
    return plan


def build_plan(cfg: dict, bits: int, head_bits: int = 6, codebook: str = "mul1", std: float = 0.02,
               mtp_bits: int = 4) -> Plan:
    """The Plan for a config dict (qwen3_5_moe target, with its MTP head when it has one, or DFlash drafter)."""
    kind = kind_of(cfg)
    if kind == "dflash":
        return dflash_plan(cfg, bits, codebook, std)
    return qwen35_plan(cfg, bits, head_bits, codebook, std, mtp_bits)
