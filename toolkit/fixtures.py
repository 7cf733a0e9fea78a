"""`python -m toolkit.fixtures`: write tiny random targets and DFlash drafters in the upstream layouts (for tests)."""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .assets.fixtures import ARCHS, fixtures, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.fixtures", description=DOC.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write into")
    ap.add_argument("--arch", default="llama", choices=[*ARCHS, "all"], help="target architecture (default llama)")
    ap.add_argument("--block-size", type=int, default=16, help="drafter block size B (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair", action="store_true", help="copy the shipped trained pair instead of building random models")
    fixtures(**vars(ap.parse_args(argv)))


if __name__ == "__main__":
    run_cli(main)
