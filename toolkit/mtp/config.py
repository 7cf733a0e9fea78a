"""Which targets carry their own MTP head, its shape, and the names its tensors are stored under.

Qwen3.5 / Qwen3.6 checkpoints ship a multi-token-prediction head beside the decoder: its config sets
`mtp_num_hidden_layers` (1 for the published models) and its tensors sit under `mtp.` at the top level of the
checkpoint, after the decoder's: `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` (2H -> H),
`mtp.layers.<i>.*` (one decoder layer of full attention, with the trunk's gated attention and its MLP or MoE) and
`mtp.norm`; it borrows the target's embedding and LM head. No torch here: the commands read it before loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.target import TargetInfo
from ..core.tensorfiles import tensor_shapes

MTP = "mtp"             # the --draft value that picks the target's own MTP head
DEPTH = 4               # draft steps per round at most (block B = DEPTH + 1): exllamav3's default MTP draft size
PREFIX = "mtp."
LAYERS_KEY = "mtp_num_hidden_layers"


def is_mtp(draft) -> bool:
    """Whether a --draft value names the target's own MTP head rather than a drafter folder."""
    return isinstance(draft, str) and draft == MTP


@dataclass(frozen=True)
class MtpShape:
    """What the MTP head of a target is made of, read from the target's text config."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    rotary_factor: float = 1.0
    experts: int = 0                 # 0: a dense MLP (Qwen3.5 dense), else a sparse MoE block (Qwen3.5/3.6 MoE)
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    intermediate: int = 0

    @classmethod
    def of(cls, text: dict) -> MtpShape:
        """The shape from a text config (the target's `text_config`, or its flat config)."""
        rope = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
        experts = int(text.get("num_experts") or 0)
        return cls(
            layers=int(text.get(LAYERS_KEY) or 0), hidden_size=hidden, heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope.get("rope_theta") or text.get("rope_theta") or 1e7),
            rotary_factor=float(rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 1.0),
            experts=experts, experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate=int(text.get("moe_intermediate_size") or 0),
            shared_intermediate=int(text.get("shared_expert_intermediate_size") or 0) if experts else 0,
            intermediate=0 if experts else int(text.get("intermediate_size") or 0))


def hf_tensors(shape: MtpShape) -> dict[str, tuple[int, ...]]:
    """name -> shape of the head's tensors in an unquantized checkpoint (experts one by one, as the trunk's are
    saved; a checkpoint may also hold them fused as `experts.gate_up_proj` / `experts.down_proj`)."""
    H, hd = shape.hidden_size, shape.head_dim
    out: dict[str, tuple[int, ...]] = {f"{PREFIX}pre_fc_norm_embedding.weight": (H,),
                                       f"{PREFIX}pre_fc_norm_hidden.weight": (H,), f"{PREFIX}fc.weight": (H, 2 * H)}
    for i in range(shape.layers):
        L = f"{PREFIX}layers.{i}"
        out.update({f"{L}.input_layernorm.weight": (H,), f"{L}.post_attention_layernorm.weight": (H,),
                    f"{L}.self_attn.q_proj.weight": (2 * shape.heads * hd, H),     # query and output gate, per head
                    f"{L}.self_attn.k_proj.weight": (shape.kv_heads * hd, H),
                    f"{L}.self_attn.v_proj.weight": (shape.kv_heads * hd, H),
                    f"{L}.self_attn.o_proj.weight": (H, shape.heads * hd),
                    f"{L}.self_attn.q_norm.weight": (hd,), f"{L}.self_attn.k_norm.weight": (hd,)})
        if shape.experts:
            I, Is = shape.moe_intermediate, shape.shared_intermediate
            out[f"{L}.mlp.gate.weight"] = (shape.experts, H)
            for e in range(shape.experts):
                out.update({f"{L}.mlp.experts.{e}.gate_proj.weight": (I, H), f"{L}.mlp.experts.{e}.up_proj.weight": (I, H),
                            f"{L}.mlp.experts.{e}.down_proj.weight": (H, I)})
            out.update({f"{L}.mlp.shared_expert.gate_proj.weight": (Is, H), f"{L}.mlp.shared_expert.up_proj.weight": (Is, H),
                        f"{L}.mlp.shared_expert.down_proj.weight": (H, Is), f"{L}.mlp.shared_expert_gate.weight": (1, H)})
        else:
            I = shape.intermediate
            out.update({f"{L}.mlp.gate_proj.weight": (I, H), f"{L}.mlp.up_proj.weight": (I, H),
                        f"{L}.mlp.down_proj.weight": (H, I)})
    out[f"{PREFIX}norm.weight"] = (H,)
    return out


def mtp_tensor_names(folder: str | Path) -> list[str]:
    """The names of a model folder's `mtp.` tensors, from its safetensors headers (no data read)."""
    names: list[str] = []
    for f in sorted(Path(folder).glob("*.safetensors")):
        names += [k for k in tensor_shapes(f) if k.startswith(PREFIX)]
    return sorted(names)


def read_mtp(folder: str | Path, info: TargetInfo | None = None) -> MtpShape:
    """The MTP head of the target in `folder`; one line saying what is missing when it carries none."""
    info = info or TargetInfo.read(folder, "target")
    text = info.text
    why = None
    layers = text.get(LAYERS_KEY)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        why = f"its config sets no {LAYERS_KEY}" if layers is None else f"its config sets {LAYERS_KEY} {layers!r}"
    elif not mtp_tensor_names(folder):
        why = f"its config sets {LAYERS_KEY} {layers} but it holds no {PREFIX}* tensors (dropped by a conversion?)"
    if why is None:
        try:
            return MtpShape.of(text)
        except (KeyError, TypeError, ValueError) as e:
            why = f"its config does not describe the head ({type(e).__name__}: {e})"
    raise ToolkitError(f"--draft {MTP}: {folder} carries no MTP head ({why}); --draft {MTP} drafts with a target's "
                       "own multi-token-prediction layer, which Qwen3.5 / Qwen3.6 checkpoints ship")
