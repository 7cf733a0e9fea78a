"""`python -m toolkit.tiny_pair`: rebuild the trained tiny target + drafter pair shipped in toolkit/data/tiny_pair.

Deterministic from --seed on one torch version; the recipe is toolkit/train/tiny.py's. Every option and --out are
checked before torch is even imported, so a refused run costs nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .assets.pairs import PAIR
from .core import checks
from .core.cli import entry, option, run
from .core.folders import claim, mark


@dataclass
class TinyPairOptions:
    out: str = option(str(PAIR), "output folder")
    seed: int = option(0, "random seed", kind="seed")
    target_steps: int = option(1500, "target training steps", lo=1)
    draft_steps: int = option(3000, "drafter training steps", lo=1)
    sequences: int = option(3072, "self-distilled sequences for the drafter", lo=1)
    force: bool = option(False, "replace a non-empty --out that is not an earlier tiny pair (once the new one is complete)")


def rebuild(out: str = str(PAIR), seed: int = 0, target_steps: int = 1500, draft_steps: int = 3000,
            sequences: int = 3072, force: bool = False) -> Path:
    """Check every option and --out before the minutes of training, then build the pair and mark it as ours."""
    checks.seed("seed", seed)
    for field, value in (("target_steps", target_steps), ("draft_steps", draft_steps), ("sequences", sequences)):
        checks.whole(field, value, 1)
    claim(out, "tiny_pair", force)
    from .train.tiny import build_pair

    final = build_pair(out, seed, target_steps, draft_steps, sequences)
    mark(final, "tiny_pair")
    return final


def main(argv: list[str] | None = None):
    run(rebuild, TinyPairOptions, argv, "python -m toolkit.tiny_pair", __doc__.split("\n\n")[0], output_policy=True)


if __name__ == "__main__":
    entry(main)
