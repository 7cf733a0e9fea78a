"""Which exllamav3 releases carry every seam the toolkit touches (toolkit/exl3/seams.py), read statically from
their wheels on the CPU: each seam's module, class, method or function must exist with the parameters the toolkit
passes, and each extension kernel must be bound in exllamav3_ext/bindings.cpp. The gpu extra's version range is
the releases that pass; the GPU runs use exllamav3 1.6.5.

    python -m experiments.seam_range --versions 1.6.0 1.6.1 1.6.2 1.6.3 1.6.4 1.6.5 [--out FILE.json]

Wheels are fetched with `pip download --no-deps` into --cache (default /tmp/exl3-wheels).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from toolkit.exl3.seams import SEAMS, Seam


class Tree:
    """A wheel's Python sources, parsed on demand."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())
        self.parsed: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self.parsed:
            base = name.replace(".", "/")
            path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.names), None)
            self.parsed[name] = ast.parse(self.zip.read(path)) if path else None
        return self.parsed[name]

    def text(self, path: str) -> str:
        return self.zip.read(path).decode() if path in self.names else ""


def absolute(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


def find(tree: Tree, module: str, name: str, depth: int = 0):
    """The top-level def or class `name` of `module`, following `from X import` re-exports (and `*`)."""
    hit = locate(tree, module, name, depth)
    return hit[1] if hit else None


def locate(tree: Tree, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """(the module that defines it, the def or class) of `name` as `module` exports it."""
    mod = tree.module(module)
    if mod is None or depth > 6:
        return None
    is_pkg = f"{module.replace('.', '/')}/__init__.py" in tree.names
    for node in mod.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return module, node
    for node in mod.body:
        if isinstance(node, ast.ImportFrom):
            src = absolute(module, node, is_pkg)
            for a in node.names:
                if a.name == "*" or (a.asname or a.name) == name:
                    hit = locate(tree, src, name if a.name == "*" else a.name, depth + 1)
                    if hit is not None:
                        return hit
    return None


def member(tree: Tree, module: str, cls: ast.AST, name: str, depth: int = 0):
    """The method `name` of class `cls` (defined in `module`) or of its bases (a mixin's included)."""
    own = next((n for n in getattr(cls, "body", []) if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if own is not None or not isinstance(cls, ast.ClassDef) or depth > 6:
        return own
    for base in cls.bases:
        hit = locate(tree, module, base.id, 0) if isinstance(base, ast.Name) else None
        if hit is not None and (got := member(tree, *hit, name, depth + 1)) is not None:
            return got
    return None


def params(node) -> set[str]:
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        return params(init) if init else set()
    a = node.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} | ({"**"} if a.kwarg else set())


def check(tree: Tree, seam: Seam) -> str | None:
    module, _, attrs = seam.path.partition(":")
    parts = attrs.split(".")
    if module == "exllamav3.ext":                          # a kernel of the compiled extension
        return None if f'"{parts[-1]}"' in tree.text("exllamav3/exllamav3_ext/bindings.cpp") else f"{seam.path} is not bound"
    hit = locate(tree, module, parts[0])
    node = hit[1] if hit else None
    for p in parts[1:]:
        node = member(tree, hit[0], node, p) if node is not None else None
    if node is None:
        return f"{seam.path} is missing"
    have = params(node)
    lacking = [p for p in seam.params if p not in have and "**" not in have]
    return f"{seam.path} takes no {lacking[0]!r}" if lacking else None


def wheel(version: str, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    found = list(cache.glob(f"exllamav3-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                        f"exllamav3=={version}"], check=True)
        found = list(cache.glob(f"exllamav3-{version}-*.whl"))
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.seam_range", description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=["1.6.0", "1.6.1", "1.6.2", "1.6.3", "1.6.4", "1.6.5"])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/exl3-wheels"), help="where wheels are kept")
    ap.add_argument("--out", type=Path, help="write the table as JSON here")
    a = ap.parse_args(argv)
    table = {}
    for v in a.versions:
        tree = Tree(wheel(v, a.cache))
        problems = {s.name: why for s in SEAMS.values() if (why := check(tree, s))}
        required = {k: w for k, w in problems.items() if not SEAMS[k].optional}
        table[v] = {"ok": not required, "problems": problems}
        print(f"exllamav3 {v}: {'every seam checks out' if not required else '; '.join(required.values())}"
              + (f" (optional: {'; '.join(w for k, w in problems.items() if SEAMS[k].optional)})"
                 if len(problems) > len(required) else ""))
    if a.out:
        a.out.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
