"""Device-side fixtures exllamav3 can load: its linears pad to multiples of 128 (and EXL3 conversion needs
128-divisible input dims), so the shipped hidden-64 pair does not load there. This trains a hidden-128 pair
with the same recipe (toolkit.train.tiny's functions and tokenizer) on the GPU in well under a minute, and
renames a Qwen3.5-MoE fixture's tensors to the `model.language_model.` prefix exllamav3 reads.

    source .device/on-device.sh && python -m experiments.pair128 --out /tmp/pair128 [--moe [--trained]]

device_check, app_device and quantize_device build their fixtures with these functions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch


def train_pair(out: Path, hidden: int = 128, target_steps: int = 1200, draft_steps: int = 1500, sequences: int = 512,
               seed: int = 0, device: str = "cuda", kv_heads: int = 4) -> tuple[Path, Path, float]:
    from transformers import AutoTokenizer

    from toolkit.dflash import save_drafter
    from toolkit.assets.fixtures import TOKENIZER, copy_tokenizer, drafter_config, target_config
    from toolkit.train.tiny import corpus, self_distill, train_drafter, train_target

    t0 = time.time()
    tdir, ddir = out / "target", out / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    special = copy_tokenizer(tdir)
    for extra in ("chat_template.jinja",):
        if (TOKENIZER / extra).exists():
            shutil.copy(TOKENIZER / extra, tdir / extra)
    torch.set_default_device(device)
    try:
        torch.manual_seed(seed)
        ids = torch.tensor(tok(corpus())["input_ids"], dtype=torch.long)
        tcfg = target_config("llama", special["vocab_size"], hidden, 4, special["eos"], special["bos"])
        tcfg["initializer_range"] = 0.02
        tcfg["num_key_value_heads"] = kv_heads          # k/v out 128: EXL3 mgemm has no kernel for 64-wide outputs
        target = train_target(ids, tcfg, target_steps)
        torch.manual_seed(seed + 1)
        seqs = self_distill(target, ids, sequences)
        dcfg = drafter_config(hidden, [0, 1, 2], special["mask"], 16, layers=2, vocab_size=special["vocab_size"],
                              window=32, target_layers=4)
        dcfg["num_key_value_heads"] = kv_heads
        drafter = train_drafter(target, seqs, dcfg, draft_steps)
    finally:
        torch.set_default_device("cpu")
    target.to("cpu").save_pretrained(str(tdir))
    save_drafter(drafter.to("cpu"), ddir, dtype=torch.bfloat16)
    return tdir, ddir, time.time() - t0


def to_language_model_prefix(src: Path, dst: Path) -> Path:
    """A copy of a Qwen3.5 text checkpoint with `model.*` tensors under `model.language_model.*`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in dst.glob("*.safetensors"):
        sd = load_file(str(f))
        save_file({("model.language_model." + k[6:]) if k.startswith("model.") else k: v for k, v in sd.items()},
                  str(f), metadata={"format": "pt"})
    idx = dst / "model.safetensors.index.json"
    if idx.exists():
        d = json.loads(idx.read_text())
        d["weight_map"] = {("model.language_model." + k[6:]) if k.startswith("model.") else k: v for k, v in d["weight_map"].items()}
        idx.write_text(json.dumps(d))
    return dst


def moe_pair(out: Path, hidden: int = 128, seed: int = 0, trained: bool = False, target_steps: int = 600,
             draft_steps: int = 800, sequences: int = 256, device: str = "cuda") -> tuple[Path, Path]:
    """A Qwen3.5-MoE-shaped target whose linear-attention widths are multiples of 128, and a drafter.

    Random by default. trained=True trains both on the docstring corpus (as train_pair does): a random MoE
    has near-flat logits, so fp16 kernels part from the AR baseline at near-ties and losslessness cannot be
    told from a rollback bug; a trained one has wide top-1 margins and a drafter that accepts partially."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from toolkit.dflash import save_drafter
    from toolkit.assets.fixtures import TOKENIZER, copy_tokenizer, drafter_config, random_drafter, spread_taps, target_config
    from toolkit.train.tiny import corpus, self_distill, train_drafter, train_target

    tdir, ddir = out / "target-src", out / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    special = copy_tokenizer(tdir)
    cfg = target_config("qwen3_5_moe", special["vocab_size"], hidden, 4, special["eos"], special["bos"])
    cfg.update(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
               num_key_value_heads=4)
    dcfg = drafter_config(hidden, spread_taps(4, 3), special["mask"], 16, 2, special["vocab_size"], target_layers=4)
    dcfg["num_key_value_heads"] = 4
    torch.manual_seed(seed)
    if trained:
        tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
        cfg["initializer_range"] = 0.02
        torch.set_default_device(device)
        try:
            ids = torch.tensor(tok(corpus())["input_ids"], dtype=torch.long)
            target = train_target(ids, cfg, target_steps)
            torch.manual_seed(seed + 1)
            seqs = self_distill(target, ids, sequences)
            drafter = train_drafter(target, seqs, dcfg, draft_steps)
        finally:
            torch.set_default_device("cpu")
        target.to("cpu", torch.bfloat16).save_pretrained(str(tdir))      # exllamav3 wants bf16 dt_bias
        save_drafter(drafter.to("cpu"), ddir, dtype=torch.bfloat16)
    else:
        conf = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
        AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16).save_pretrained(str(tdir))
        save_drafter(random_drafter(dcfg, seed), ddir, dtype=torch.bfloat16)
    copy_tokenizer(tdir)
    return to_language_model_prefix(tdir, out / "target"), ddir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.pair128", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for target/ and draft/")
    ap.add_argument("--moe", action="store_true", help="the Qwen3.5-MoE-shaped pair (random unless --trained)")
    ap.add_argument("--trained", action="store_true", help="with --moe: train it on the docstring corpus")
    ap.add_argument("--device", default="cuda", help="where training runs (default cuda)")
    a = ap.parse_args(argv)
    if a.moe:
        t, d = moe_pair(a.out, trained=a.trained, device=a.device)
        print(f"target {t}\ndraft {d}")
    else:
        t, d, secs = train_pair(a.out, device=a.device)
        print(f"target {t}\ndraft {d}\ntrained in {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
