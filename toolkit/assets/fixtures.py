"""Tiny offline models for tests and device runs: random targets and drafters in the upstream layouts.

`build()` writes a random target (Llama, Qwen3 or the Qwen3.5/3.6 MoE text model, scaled down) and a random
DFlash drafter for it; with `mtp` the Qwen3.5/3.6 target also carries a random MTP head (`--draft mtp`). Random drafters accept almost nothing, so `tiny_pair()` also ships a small *trained*
pair (see toolkit/tiny_pair.py) whose rounds show zero, partial and full acceptance. torch loads only in the builders,
so `fixtures()` refuses a bad --out or option before it does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..dflash import DFlashConfig
from ..dflash.shapes import drafter_config, kv_heads, spread_taps
from .pairs import ARCHS, PAIR, tiny_pair
from ..core import checks
from ..core.errors import OptionError, ToolkitError
from ..core.folders import atomic_dir, claim

if TYPE_CHECKING:
    from ..dflash import DFlashDraft

TOKENIZER = PAIR / "target"           # the fixtures' BPE tokenizer (trained on stdlib docstrings) lives here
MASK_TOKEN = "<|mask|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def copy_tokenizer(out: Path) -> dict:
    """Copy the fixtures' tokenizer files into `out`; returns its special ids and vocab size."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = TOKENIZER / name
        if src.exists():
            shutil.copy(src, out / name)
    vocab = json.loads((TOKENIZER / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    size = max(len(vocab["model"]["vocab"]), max(ids.values()) + 1)
    return {"mask": ids[MASK_TOKEN], "eos": ids["<|im_end|>"], "bos": ids["<|endoftext|>"], "vocab_size": size}


def target_config(arch: str, vocab_size: int, hidden: int = 64, layers: int = 4, eos: int = 0, bos: int = 0) -> dict:
    """A tiny HF config dict for one of the supported target architectures."""
    common = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads(hidden), head_dim=hidden // 4,
        intermediate_size=2 * hidden, vocab_size=vocab_size, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=bos, initializer_range=0.2,
    )
    if arch == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0}
    if arch == "qwen3":
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1e6}
    if arch == "qwen3_5_moe":
        types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
        return {
            **common, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "layer_types": types,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": hidden,
            "shared_expert_intermediate_size": hidden, "num_experts": 4, "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        }
    raise ToolkitError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")


def random_drafter(cfg: dict, seed: int = 0, std: float = 0.2) -> DFlashDraft:
    import torch

    from ..dflash import DFlashDraft

    torch.manual_seed(seed)
    model = DFlashDraft(DFlashConfig.from_dict(cfg))
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
    return model


def write_target(model, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    copy_tokenizer(out)
    return out


def add_mtp(target: Path, seed: int = 0, std: float = 0.2) -> Path:
    """Give a Qwen3.5/3.6 target folder a random MTP head: `mtp_num_hidden_layers` 1 in its config and the head's
    tensors (names and shapes of mtp.config.hf_tensors, norms at 0 as Qwen3.5 stores them) in its safetensors."""
    import torch

    from ..core.tensorfiles import load_tensors, save_tensors
    from ..mtp import MtpShape, hf_tensors

    cfg = json.loads((target / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    g = torch.Generator().manual_seed(seed + 1)
    tensors = load_tensors(target / "model.safetensors")
    for name, shape in hf_tensors(MtpShape.of(cfg)).items():
        tensors[name] = torch.zeros(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * std
    save_tensors(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    return target


def build(out_dir: str | Path, arch: str = "llama", block_size: int = 16, seed: int = 0, layers: int = 4,
          hidden: int = 64, draft_layers: int = 2, mtp: bool = False) -> tuple[Path, Path]:
    """Write a random tiny target `<out>/target-<arch>` (`-mtp` with an MTP head) and a random drafter
    `<out>/draft-<arch>-b<B>`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..dflash import save_drafter

    if block_size < 2:
        raise ToolkitError(f"block_size must be >= 2, got {block_size}")
    if mtp and arch != "qwen3_5_moe":
        raise ToolkitError(f"an MTP head needs the qwen3_5_moe target (Qwen3.5/3.6 carry one), got {arch!r}")
    out = Path(out_dir)
    tdir, ddir = out / f"target-{arch}{'-mtp' if mtp else ''}", out / f"draft-{arch}-b{block_size}"
    tmp = out / ".tok"
    tmp.mkdir(parents=True, exist_ok=True)
    special = copy_tokenizer(tmp)
    shutil.rmtree(tmp)
    cfg = target_config(arch, special["vocab_size"], hidden, layers, special["eos"], special["bos"])
    torch.manual_seed(seed)
    conf = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    write_target(model, tdir)
    if mtp:
        add_mtp(tdir, seed)
    dcfg = drafter_config(hidden, spread_taps(layers, 3), special["mask"], block_size, draft_layers, special["vocab_size"],
                          target_layers=layers)
    save_drafter(random_drafter(dcfg, seed), ddir, dtype=torch.float32)
    return tdir, ddir


def fixtures(out: str, arch: str = "llama", block_size: int = 16, seed: int = 0, pair: bool = False,
             force: bool = False, mtp: bool = False) -> list[dict]:
    """Write the fixture models into `out` as one folder, all or nothing (docs/outputs.md): a non-empty `out`
    that is not an earlier fixtures folder is refused unless `force`. Prints one JSON line per pair."""
    if arch not in (*ARCHS, "all"):
        raise OptionError("arch", f"must be one of {', '.join(ARCHS)} or all, got {arch!r}")
    if mtp and (arch != "qwen3_5_moe" or pair):
        raise OptionError("mtp", f"needs --arch qwen3_5_moe (the Qwen3.5/3.6 target) without --pair, got --arch {arch}"
                          + (" --pair" if pair else ""))
    checks.whole("block_size", block_size, 2, 1024)
    checks.seed("seed", seed)
    final = claim(out, "fixtures", force)
    written = []
    with atomic_dir(final, command="fixtures") as work:
        if pair:
            for src, name in zip(tiny_pair(), ("target", "draft")):
                shutil.copytree(src, work / name, ignore=shutil.ignore_patterns(".*"))
            written.append({"target": str(final / "target"), "draft": str(final / "draft")})
        else:
            for a in ARCHS if arch == "all" else [arch]:
                t, d = build(work, a, block_size, seed, mtp=mtp)
                written.append({"arch": a, "target": str(final / t.name), "draft": str(final / d.name)})
    for line in written:
        print(json.dumps(line))
    return written
