"""`python -m toolkit.space export DIR`: write a ready-to-push Hugging Face Space folder running the chat app."""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .hub.space import HARDWARE, export, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.space", description=DOC.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a ready-to-push Space folder")
    ex.add_argument("dir", help="folder to write (must be empty or absent unless --force)")
    ex.add_argument("--target", help="target model Hub id the Space loads (default: the embedded tiny demo)")
    ex.add_argument("--draft", help="DFlash drafter Hub id (with --target)")
    ex.add_argument("--hardware", default="l4x1", choices=HARDWARE, help="suggested_hardware (default l4x1); "
                    "cpu-* leaves exllamav3 out, zero-* runs the torch backend under @spaces.GPU")
    ex.add_argument("--backend", default="auto", help="auto (default), torch or exllamav3")
    ex.add_argument("--title", default="DFlash speculative decoding")
    ex.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    args = vars(ap.parse_args(argv))
    args.pop("command")
    export(**args)


if __name__ == "__main__":
    run_cli(lambda: main())
