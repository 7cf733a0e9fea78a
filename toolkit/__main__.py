"""`python -m toolkit`: list the commands, one line each (every module at the package root is one)."""

from __future__ import annotations

import ast
import pkgutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands() -> dict[str, str]:
    """Command name -> the first line of its docstring, read without importing the module."""
    out = {}
    for m in pkgutil.iter_modules([str(HERE)]):
        if m.ispkg or m.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse((HERE / f"{m.name}.py").read_text())) or ""
        out[m.name] = doc.split("\n\n")[0].replace("\n", " ")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmds = commands()
    if argv and argv[0] not in ("-h", "--help"):
        print(f"error: unknown command {argv[0]!r}; run `python -m toolkit` for the list", file=sys.stderr)
        return 2
    print("usage: python -m toolkit.<command> [--help]\n\ncommands:")
    width = max(map(len, cmds))
    for name, doc in cmds.items():
        line = doc.split(": ", 1)[1] if doc.startswith("`") and ": " in doc else doc
        print(f"  {name:<{width}}  {line}")
    print("\nThe chat app: python app.py [--help] (docs/app.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
