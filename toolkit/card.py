"""`python -m toolkit.card --from OUT`: print the model card that push would upload, to read it before publishing.

Without --bits it is main's card (every bitrate); with --bits B it is that bitrate's branch README. --repo fills in
the real repo name in links and download lines (default: USER/REPO).
"""

from __future__ import annotations

from dataclasses import dataclass

from .core.cli import entry, option, run
from .hub.card import run_card


@dataclass
class CardOptions:
    out_dir: str = option(help="the quantize OUT folder (report.json, upstream/)", flag="--from")
    repo: str | None = option(None, "the Hub repo it will be pushed to, USER/NAME")
    bits: float | None = option(None, "print this bitrate's branch card instead of main's", above=0, hi=16)


def main(argv: list[str] | None = None) -> str:
    text = run(run_card, CardOptions, argv, "python -m toolkit.card", __doc__.split("\n\n")[0].split(": ", 1)[1],
               epilog="Prints to stdout and writes no files (output policy: docs/outputs.md).")
    print(text, end="")
    return text


if __name__ == "__main__":
    entry(main)
