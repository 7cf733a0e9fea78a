"""`python -m toolkit.fixtures`: write tiny random targets and DFlash drafters in the upstream layouts (for tests)."""

from __future__ import annotations

from dataclasses import dataclass

from .assets.fixtures import ARCHS, __doc__ as DOC, fixtures
from .core.cli import entry, option, run


@dataclass
class FixturesOptions:
    out: str = option(help="folder to write into")
    arch: str = option("llama", "target architecture", choices=[*ARCHS, "all"])
    block_size: int = option(16, "drafter block size B", lo=2, hi=1024)
    seed: int = option(0, "random seed", kind="seed")
    pair: bool = option(False, "copy the shipped trained pair instead of building random models")
    force: bool = option(False, "replace a non-empty --out that is not an earlier fixtures folder (once the new one is complete)")


def main(argv: list[str] | None = None):
    run(fixtures, FixturesOptions, argv, "python -m toolkit.fixtures", DOC.split("\n\n")[0], output_policy=True)


if __name__ == "__main__":
    entry(main)
