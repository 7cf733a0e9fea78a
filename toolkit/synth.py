"""`python -m toolkit.synth`: write a synthetic EXL3 checkpoint of the exact shape of an HF config.

Random trellis codes (every state equally likely) with suh/svh scales that decode to weights of mean 0
and the requested std; norms at 1, embeddings random, a config.json with exllamav3's quantization_config
and, for a target, a stand-in tokenizer of the config's vocab size. For timing and memory work only: the
model's outputs mean nothing. Tensors are made on the GPU when there is one, written shard by shard
into a temp folder beside --out that is renamed into place at the end (nothing half-written is left).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .core.cli import OUTPUT_POLICY, entry, option, run

EPILOG = """examples:
  python -m toolkit.synth --config quantize/shapes/qwen3.6-35b-a3b.json --bits 4 --out /tmp/q36-4bpw
  python -m toolkit.synth --config quantize/shapes/qwen3.6-35b-a3b-dflash.json --bits 6 --out /tmp/dflash-6bpw
  python -m toolkit.synth --config quantize/shapes/qwen3.6-35b-a3b-mtp.json --bits 4 --out /tmp/q36-mtp-4bpw

supported configs: qwen3_5_moe targets (hub layout with text_config, or the flat text config; one whose text config
sets mtp_num_hidden_layers is written with its MTP head, in the multimodal layout exllamav3 drafts with it from) and
DFlashDraftModel drafters. The last stdout line is a JSON summary (size, shards, decoded-weight check)."""


def synth(**options) -> dict:
    """The inputs checked first (synthetic/inputs.py, without torch), then the writer, imported on use: torch loads
    only to write a checkpoint, not for --help or bad input."""
    from .synthetic.inputs import check_inputs

    inputs = check_inputs(**options)
    from .synthetic.build import write

    return write(*inputs)


@dataclass
class SynthOptions:
    config: str = option(help="HF config.json of the model to imitate (e.g. one under quantize/shapes/)")
    bits: float = option(help="bits per weight of the decoder linears: an integer 1-8", lo=1, hi=8, whole=True)
    out: str = option(help="folder to create (must not exist or be empty, unless --overwrite)")
    head_bits: float = option(6.0, "bits of the lm_head: 1-8, or 16 for fp16 (6 as the converter)", lo=1, hi=16,
                              whole=True)
    mtp_bits: float = option(4.0, "bits of the MTP head's linears, for a shape that has one (mtp_num_hidden_layers): "
                             "1-8, or 16 for fp16 (4 as the converter)", lo=1, hi=16, whole=True)
    codebook: str = option("mul1", "trellis codebook (mul1 as the converter)", choices=["mul1", "mcg", "3inst"])
    seed: int = option(0, "random seed", kind="seed")
    std: float | None = option(None, "std of the decoded weights (default: the config's initializer_range, else 0.02)",
                               above=0, hi=100)
    shard_gb: float = option(4.0, "approximate shard size in GiB", above=0, hi=1024)
    device: str = option("auto", "where to generate: auto (cuda if available), cpu or cuda[:N]", kind="device_auto")
    routing: str = option("random", "MoE router rows: random (every expert equally likely: the upper bound of a "
                          "verify round's cost) or skewed (some experts win more often, so windows of 8 and 15 "
                          "tokens touch about as many distinct experts as published for real routing)",
                          choices=["random", "skewed"])
    overwrite: bool = option(False, "replace a non-empty --out (only once the new one is complete)")
    quiet: bool = option(False, "no progress bar")


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(run(synth, SynthOptions, argv, "python -m toolkit.synth", __doc__.split("\n\n")[0],
                         epilog=f"{EPILOG}\n\n{OUTPUT_POLICY.replace('--force', '--overwrite')}")))


if __name__ == "__main__":
    entry(main)
