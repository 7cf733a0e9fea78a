"""Device probe: does exllamav3 1.6.5 take SmolLM2-135M's shapes (hidden 576, 9 Q / 3 KV heads of 64, 30 layers,
tied 49152-token embeddings) as a target, and a DFlash drafter at hidden 576, BF16 and EXL3? Random weights.
With --padded, both go through toolkit.assets.padding first (hidden 768, 12 Q / 4 KV heads; same function).

2026-12-02 15:20 UTC on the H200: unpadded, loading fails (`size of tensor a (576) must match ... (640)`)
and EXL3 conversion fails (`assert n % had_dim == 0`).

    source .device/on-device.sh && python -m experiments.shape576 [--padded]     # writes $OUT/shape576.json

576 and 192 are not multiples of 128 (exllamav3 pads linears to 128), so this is checked before the real
SmolLM2 pair is carried to the device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from experiments.harness import Run, convert_exl3

WORK = Path("/tmp/shape576")


def smol_like(out: Path, draft_layers: int = 3) -> tuple[Path, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.dflash import save_drafter
    from toolkit.assets.fixtures import copy_tokenizer, drafter_config, random_drafter, target_config

    tdir, ddir = out / "target", out / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    special = copy_tokenizer(tdir)
    cfg = target_config("llama", 49152, 576, 30, special["eos"], special["bos"])
    cfg.update(num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536, tie_word_embeddings=True,
               initializer_range=0.02, max_position_embeddings=8192, rope_theta=100000.0)
    torch.manual_seed(0)
    conf = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    AutoModelForCausalLM.from_config(conf, dtype=torch.float16).save_pretrained(str(tdir))
    copy_tokenizer(tdir)
    dcfg = drafter_config(576, [1, 8, 15, 22, 28], special["mask"], 16, draft_layers, 49152, window=512, target_layers=30,
                          intermediate=1536)
    dcfg.update(num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    save_drafter(random_drafter(dcfg, 0, std=0.02), ddir, dtype=torch.bfloat16)
    return tdir, ddir


def decode(t: Path, d: Path | None) -> dict:
    from toolkit.runtime.backend import GenSettings
    from toolkit.runtime.events import tokens_of
    from toolkit.exl3.backend import Exl3Backend

    be = Exl3Backend.from_dirs(t, d, cache_tokens=4096, max_concurrency=4)
    try:
        p = list(range(5, 37))
        st = GenSettings(max_new_tokens=24, block_size=16)
        ar = tokens_of(be.generate(p, st, speculative=False))
        spec = tokens_of(be.generate(p, st)) if d else ar
        return {"ar": ar[:8], "lossless": spec == ar}
    finally:
        be.close()


def decode_exl3(t: Path, d: Path, bits: float) -> dict:
    dst = WORK / f"draft-{bits}"
    convert_exl3(Path(d), dst, bits, WORK / f"w{bits}")
    return decode(t, dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.shape576", description=__doc__.split("\n\n")[0])
    ap.add_argument("--padded", action="store_true", help="pad both models to hidden 768 with toolkit.assets.padding first")
    a = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    run = Run("shape576.json")
    t, d = smol_like(WORK)
    if a.padded:
        from toolkit.assets.padding import pad

        t, d = pad(str(t), str(WORK / "target-pad")), pad(str(d), str(WORK / "draft-pad"))
    run.step("target_alone", decode, t, None)
    run.step("bf16_drafter", decode, t, d)
    for b in (2.0, 4.0):
        run.step(f"exl3_{b}_drafter", decode_exl3, t, d, b)
    run.finish()
    return 0                    # a failing step is a finding of the probe, not a failed run


if __name__ == "__main__":
    sys.exit(main())
