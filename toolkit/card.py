"""`python -m toolkit.card --from OUT`: print the model card that push would upload, to read it before publishing.

Without --bits it is main's card (every bitrate); with --bits B it is that bitrate's branch README. --repo fills in
the real repo name in links and download lines (default: USER/REPO).
"""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .hub.card import run_card


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m toolkit.card", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--from", dest="out_dir", required=True, help="the quantize OUT folder (report.json, upstream/)")
    p.add_argument("--repo", default=None, help="the Hub repo it will be pushed to, USER/NAME")
    p.add_argument("--bits", type=float, default=None, help="print this bitrate's branch card instead of main's")
    text = run_card(**vars(p.parse_args(argv)))
    print(text, end="")
    return text


if __name__ == "__main__":
    run_cli(main)
