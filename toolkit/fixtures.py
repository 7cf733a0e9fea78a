"""`python -m toolkit.fixtures`: write tiny random targets and DFlash drafters in the upstream layouts (for tests)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from .assets.pairs import ARCHS
from .core.cli import entry, option, run

DOC = ast.get_docstring(ast.parse((Path(__file__).parent / "assets" / "fixtures.py").read_text()))   # without torch


def fixtures(**options) -> list[dict]:
    """The fixtures' builder, imported on use (torch loads only to build them, not for --help)."""
    from .assets.fixtures import fixtures as build

    return build(**options)


@dataclass
class FixturesOptions:
    out: str = option(help="folder to write into")
    arch: str = option("llama", "target architecture", choices=[*ARCHS, "all"])
    block_size: int = option(16, "drafter block size B", lo=2, hi=1024)
    seed: int = option(0, "random seed", kind="seed")
    pair: bool = option(False, "copy the shipped trained pair instead of building random models")
    mtp: bool = option(False, "give the qwen3_5_moe target a random MTP head too (for --draft mtp)")
    force: bool = option(False, "replace a non-empty --out that is not an earlier fixtures folder (once the new one is complete)")


def main(argv: list[str] | None = None):
    run(fixtures, FixturesOptions, argv, "python -m toolkit.fixtures", DOC.split("\n\n")[0], output_policy=True)


if __name__ == "__main__":
    entry(main)
