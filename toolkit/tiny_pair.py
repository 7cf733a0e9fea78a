"""`python -m toolkit.tiny_pair`: rebuild the trained tiny target + drafter pair shipped in toolkit/data/tiny_pair."""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .assets.pairs import PAIR
from .train.tiny import build_pair, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.tiny_pair", description=DOC.split("\n\n")[0])
    ap.add_argument("--out", default=str(PAIR), help=f"output folder (default {PAIR})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--draft-steps", type=int, default=3000)
    ap.add_argument("--sequences", type=int, default=3072, help="self-distilled sequences for the drafter")
    build_pair(**vars(ap.parse_args(argv)))


if __name__ == "__main__":
    run_cli(main)
