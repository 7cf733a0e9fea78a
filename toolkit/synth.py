"""`python -m toolkit.synth`: write a synthetic EXL3 checkpoint of the exact shape of an HF config.

Random trellis codes (every state equally likely) with suh/svh scales that decode to weights of mean 0
and the requested std; norms at 1, embeddings random, a config.json with exllamav3's quantization_config
and, for a target, a stand-in tokenizer of the config's vocab size. For timing and memory work only: the
model's outputs mean nothing. Tensors are made on the GPU when there is one, written shard by shard
into a temp folder beside --out that is renamed into place at the end (nothing half-written is left).
"""

from __future__ import annotations

import argparse
import json

from .core.errors import run_cli
from .synthetic.build import synth

EPILOG = """examples:
  python -m toolkit.synth --config quantize/shapes/qwen3.6-35b-a3b.json --bits 4 --out /tmp/q36-4bpw
  python -m toolkit.synth --config quantize/shapes/qwen3.6-35b-a3b-dflash.json --bits 6 --out /tmp/dflash-6bpw

supported configs: qwen3_5_moe targets (hub layout with text_config, or the flat text config) and
DFlashDraftModel drafters. The last stdout line is a JSON summary (size, shards, decoded-weight check)."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.synth", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="HF config.json of the model to imitate (e.g. one under quantize/shapes/)")
    ap.add_argument("--bits", required=True, type=float, help="bits per weight of the decoder linears: an integer 1-8")
    ap.add_argument("--out", required=True, help="folder to create (must not exist or be empty, unless --overwrite)")
    ap.add_argument("--head-bits", type=float, default=6, help="bits of the lm_head: 1-8, or 16 for fp16 (default 6, as the converter)")
    ap.add_argument("--codebook", default="mul1", choices=["mul1", "mcg", "3inst"], help="trellis codebook (default mul1, as the converter)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--std", type=float, help="std of the decoded weights (default: the config's initializer_range, else 0.02)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="approximate shard size in GiB (default 4)")
    ap.add_argument("--device", default="auto", help="where to generate: auto (cuda if available), cpu or cuda[:N]")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (only once the new one is complete)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    print(json.dumps(synth(**vars(ap.parse_args(argv)))))


if __name__ == "__main__":
    run_cli(main)
