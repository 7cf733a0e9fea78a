"""Zero-pad a dense Llama-family checkpoint to 128-aligned widths, computing the same function.

exllamav3 1.6.5 pads every linear to a multiple of 128 and its EXL3 quantizer needs 128-divisible input
dims, so a model such as SmolLM2-135M (hidden 576, K/V width 192) neither loads nor converts there (seen on
the device). Padding fixes that without changing a single logit:

- hidden H -> H' (multiple of 128): new residual dims are zero in the embeddings and in every output
  projection, so they stay zero; RMSNorm weights are scaled by sqrt(H/H') and eps by H/H', which undoes
  the wider mean of squares.
- K/V heads k -> k' (keeping the GQA group g = q/k): extra heads have zero q/k/v rows and zero o_proj
  columns, so they attend uniformly over zero values and add nothing.
- intermediate I -> I': zero gate/up rows, zero down columns (silu(0) * 0 = 0).
- a DFlash drafter (upstream layout) pads the same way; its `fc` maps each tap's H dims to that tap's first H
  of H' dims, so a padded drafter reads a padded target's taps exactly as the original read the original's.
H' is also a multiple of the new head count (transformers checks hidden % heads), e.g. SmolLM2: 576 -> 768.
Exact in fp32; in fp16 storage the rescaled norm weights round (SmolLM2: logits within 0.055, same argmax).

    python -m toolkit.pad SRC DST        # then check: logits of SRC and DST agree
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import OptionError, ToolkitError
from ..core.folders import MARKER, atomic_dir, claim, read_config
from ..core.kinds import kind_of
from ..core.target import TargetInfo
from ..core.tensorfiles import check_folder, load_tensors, save_tensors

if TYPE_CHECKING:          # torch loads only when padding runs: a refused option costs no torch import
    import torch

ALIGN = 128
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class Widths:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def width(cfg: dict, key: str, default: int | None = None) -> int:
    """A positive integer width of the config (`default` when absent or null); anything else is one line."""
    v = cfg.get(key)
    if v is None and default is not None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ToolkitError(f"config.json: {key} must be a positive integer, got {v!r}")
    return v


def padded_widths(cfg: dict, align: int = ALIGN) -> tuple[Widths, Widths]:
    """(original, padded) widths of a config; the padded ones are all multiples of `align`."""
    if cfg.get("model_type") not in FAMILIES and "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ToolkitError(f"padding supports dense {', '.join(FAMILIES)} models, not model_type {cfg.get('model_type')!r}")
    h, q = width(cfg, "hidden_size"), width(cfg, "num_attention_heads")
    k = width(cfg, "num_key_value_heads", q)
    d = width(cfg, "head_dim", h // q)
    width(cfg, "intermediate_size")
    if q % k:
        raise ToolkitError(f"{q} attention heads are not a multiple of {k} K/V heads")
    g = q // k
    k2 = next(n for n in range(k, k + align + 1) if (n * d) % align == 0 and (n * g * d) % align == 0)
    h2 = up(h, math.lcm(align, k2 * g))
    return Widths(h, q, k, d, int(cfg["intermediate_size"])), Widths(h2, k2 * g, k2, d, up(int(cfg["intermediate_size"]), align))


def pad_to(t: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    out = t.new_zeros((rows,) if t.dim() == 1 else (rows, cols))
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def pad_state(sd: dict[str, torch.Tensor], a: Widths, b: Widths) -> dict[str, torch.Tensor]:
    """The padded tensors of a Llama-family state dict (names as transformers saves them)."""
    norm = math.sqrt(a.hidden / b.hidden)
    out = {}
    for name, t in sd.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") or name.endswith(".bias") else name
        if name.endswith("norm.weight") and t.shape == (a.hidden,):
            out[name] = pad_to(t.float() * norm, b.hidden).to(t.dtype)          # input/post-attention/final norms
        elif leaf == "fc":                      # DFlash: [H, taps * H] -> [H', taps * H'], tap by tap
            n = t.shape[1] // a.hidden
            w = t.new_zeros((b.hidden, n * b.hidden))
            for j in range(n):
                w[: a.hidden, j * b.hidden : j * b.hidden + a.hidden] = t[:, j * a.hidden : (j + 1) * a.hidden]
            out[name] = w
        elif leaf in ("embed_tokens", "lm_head"):
            out[name] = pad_to(t, t.shape[0], b.hidden)
        elif leaf == "q_proj":
            out[name] = pad_to(t, b.heads * b.head_dim, b.hidden) if t.dim() == 2 else pad_to(t, b.heads * b.head_dim)
        elif leaf in ("k_proj", "v_proj"):
            out[name] = pad_to(t, b.kv_heads * b.head_dim, b.hidden) if t.dim() == 2 else pad_to(t, b.kv_heads * b.head_dim)
        elif leaf == "o_proj":
            out[name] = pad_to(t, b.hidden, b.heads * b.head_dim) if t.dim() == 2 else pad_to(t, b.hidden)
        elif leaf in ("gate_proj", "up_proj"):
            out[name] = pad_to(t, b.intermediate, b.hidden)
        elif leaf == "down_proj":
            out[name] = pad_to(t, b.hidden, b.intermediate)
        else:                                   # q_norm/k_norm act per head_dim, which does not change
            out[name] = t
    return out


def padded_config(cfg: dict, a: Widths, b: Widths) -> dict:
    new = dict(cfg)
    new.update(hidden_size=b.hidden, num_attention_heads=b.heads, num_key_value_heads=b.kv_heads, head_dim=b.head_dim,
               intermediate_size=b.intermediate, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)) * a.hidden / b.hidden)
    new["padded_from"] = {"hidden_size": a.hidden, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
                          "intermediate_size": a.intermediate, "rms_norm_eps": cfg.get("rms_norm_eps"),
                          "note": "zero-padded to 128-aligned widths by toolkit.pad; same function"}
    return new


def pad(src: str, dst: str, align: int = ALIGN, force: bool = False) -> Path:
    """Write a padded copy of the model folder `src` to `dst` (atomically); other files are copied as they are.
    A non-empty `dst` that is not an earlier padded folder is refused unless `force` (docs/outputs.md); SRC must be
    an unquantized model (an EXL3 checkpoint is refused by kind) with readable safetensors files."""
    if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 4096:
        raise OptionError("align", f"must be a whole number from 1 to 4096, got {align!r}")
    s, d = Path(src), claim(dst, "pad", force, field="dst")
    if not s.is_dir():
        raise OptionError("src", f"{s} is not a folder")
    if d.resolve() == s.resolve() or s.resolve() in d.resolve().parents:
        raise OptionError("dst", f"{d} is SRC itself or inside it: name a new folder")
    if not (s / "config.json").is_file():
        raise OptionError("src", f"{s} has no config.json (not a model folder)")
    cfg = read_config(s)
    if not isinstance(cfg, dict):
        raise OptionError("src", f"{s / 'config.json'} is not a JSON object")
    info = TargetInfo(cfg)
    if info.exl3:
        raise OptionError("src", f"{s} is {kind_of(info)}: only unquantized safetensors weights can be padded")
    a, b = padded_widths(cfg, align)
    try:
        files = check_folder(s)
    except ToolkitError as e:
        raise OptionError("src", str(e)) from None
    if not files:
        raise ToolkitError(f"{s}: no .safetensors weights to pad")
    with atomic_dir(d, command="pad", need=sum(f.stat().st_size for f in files) * 2) as work:
        for f in s.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and f.name != MARKER:
                shutil.copy2(f, work / f.name)
        for f in files:
            save_tensors(pad_state(load_tensors(f, "src"), a, b), work / f.name, metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(padded_config(cfg, a, b), indent=2))
    return d
