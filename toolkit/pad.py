"""`python -m toolkit.pad SRC DST`: zero-pad a dense target or its DFlash drafter to 128-aligned widths for exllamav3 (same function)."""

from __future__ import annotations

from dataclasses import dataclass

from .assets.padding import ALIGN, __doc__ as DOC, pad
from .core.cli import entry, option, run


@dataclass
class PadOptions:
    src: str = option(help="HF model folder (dense Llama family, safetensors), or its DFlash drafter", positional=True)
    dst: str = option(help="output folder, written whole once complete", positional=True)
    align: int = option(ALIGN, "width multiple", lo=1, hi=4096)
    force: bool = option(False, "replace a non-empty DST that is not an earlier padded folder")


def main(argv: list[str] | None = None):
    print(run(pad, PadOptions, argv, "python -m toolkit.pad", DOC.split("\n\n")[0], output_policy=True))


if __name__ == "__main__":
    entry(main)
