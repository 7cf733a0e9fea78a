"""`python -m toolkit.pad SRC DST`: zero-pad a dense target or its DFlash drafter to 128-aligned widths for exllamav3 (same function)."""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .assets.padding import ALIGN, pad, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.pad", description=DOC.split("\n\n")[0])
    ap.add_argument("src", help="HF model folder (dense Llama family, safetensors)")
    ap.add_argument("dst", help="output folder (replaced when complete)")
    ap.add_argument("--align", type=int, default=ALIGN, help=f"width multiple (default {ALIGN})")
    args = ap.parse_args(argv)
    print(pad(**vars(args)))


if __name__ == "__main__":
    run_cli(main)
