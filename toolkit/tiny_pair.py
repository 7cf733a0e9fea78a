"""`python -m toolkit.tiny_pair`: rebuild the trained tiny target + drafter pair shipped in toolkit/data/tiny_pair."""

from __future__ import annotations

from dataclasses import dataclass

from .assets.pairs import PAIR
from .core.cli import entry, option, run
from .train.tiny import __doc__ as DOC, build_pair


@dataclass
class TinyPairOptions:
    out: str = option(str(PAIR), "output folder")
    seed: int = option(0, "random seed")
    target_steps: int = option(1500, "target training steps")
    draft_steps: int = option(3000, "drafter training steps")
    sequences: int = option(3072, "self-distilled sequences for the drafter")


def main(argv: list[str] | None = None):
    run(build_pair, TinyPairOptions, argv, "python -m toolkit.tiny_pair", DOC.split("\n\n")[0])


if __name__ == "__main__":
    entry(main)
