"""`python -m toolkit.space export DIR`: write a ready-to-push Hugging Face Space folder running the chat app."""

from __future__ import annotations

from .core.cli import entry, run_sub
from .hub.space import ExportOptions, __doc__ as DOC, export


def main(argv: list[str] | None = None):
    subs = {"export": (lambda **kw: export(ExportOptions(**kw)), ExportOptions, "write a ready-to-push Space folder")}
    return run_sub(subs, argv, "python -m toolkit.space", DOC.split("\n\n")[0], output_policy=True)


if __name__ == "__main__":
    entry(lambda argv: main(argv) and 0)
