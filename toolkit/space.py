"""`python -m toolkit.space export DIR`: write a ready-to-push Hugging Face Space folder running the chat app."""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .hub.space import CUDA_VERSION, HARDWARE, PYTHON_VERSION, TORCH_VERSION, export, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.space", description=DOC.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a ready-to-push Space folder")
    ex.add_argument("dir", help="folder to write (must be empty or absent unless --force)")
    ex.add_argument("--target", help="target model Hub id the Space loads (default: the embedded tiny demo)")
    ex.add_argument("--draft", help="DFlash drafter Hub id (with --target)")
    ex.add_argument("--hardware", default="l4x1", choices=HARDWARE, help="suggested_hardware (default l4x1); "
                    "cpu-* leaves exllamav3 out, zero-* runs the torch backend under @spaces.GPU, GPU hardware "
                    "installs exllamav3's prebuilt wheel")
    ex.add_argument("--backend", default="auto", help="auto (default), torch or exllamav3; torch installs no exllamav3")
    ex.add_argument("--python", default=PYTHON_VERSION, help="the Space's python_version and the wheel's CPython "
                    "(default %(default)s)")
    ex.add_argument("--torch", default=TORCH_VERSION, help="torch the Space pins, with the exllamav3 wheel built "
                    "against it (default %(default)s)")
    ex.add_argument("--cuda", default=CUDA_VERSION, help="CUDA of that torch and wheel (default %(default)s)")
    ex.add_argument("--exllamav3-jit", action="store_true", help="install exllamav3 from PyPI instead and let it "
                    "compile its CUDA extension on the Space (needs nvcc; for hardware no wheel covers)")
    ex.add_argument("--title", default="DFlash speculative decoding")
    ex.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    args = vars(ap.parse_args(argv))
    args.pop("command")
    export(**args)


if __name__ == "__main__":
    run_cli(lambda: main())
