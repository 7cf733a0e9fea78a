"""Copying a folder into an output (a model into a Space, the toolkit package) without ever following a link to a
folder, so no link can make the copy loop or reach outside what is copied (docs/outputs.md, rule 4)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import ToolkitError


def tree_files(src: str | Path, ignore: Callable | None = None, what: str = "") -> list[tuple[Path, Path]]:
    """(path inside `src`, file to copy) of every file of the folder `src`, found without ever following a link to a
    folder, so no link can make a copy loop or reach outside `src`: a link to a file inside `src` stands for that
    file; any other link (to a folder, out of `src`, broken) and anything that is neither a file nor a folder is
    refused with one line naming it. `ignore` is shutil.ignore_patterns' kind of callable."""
    src, pre, out = Path(src), f"{what}: " if what else "", []
    root = src.resolve()

    def refuse(e: OSError):
        raise ToolkitError(f"{pre}cannot read {e.filename} ({e.strerror or e})")

    for dirpath, dirnames, filenames in os.walk(src, onerror=refuse):
        here = Path(dirpath)
        skip = set(ignore(dirpath, dirnames + filenames)) if ignore else set()
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in dirnames + [f for f in filenames if f not in skip]:
            p = here / name
            real = p.resolve()
            if p.is_symlink() and not (real.is_file() and root in real.parents):
                raise ToolkitError(f"{pre}{p} is a link to {os.readlink(p)}; a copied folder may link only to files "
                                   "inside it (no link to a folder, none out of it): copy the files themselves")
            if name in dirnames and not p.is_symlink():
                continue                                   # os.walk enters it next
            if not real.is_file():
                raise ToolkitError(f"{pre}{p} is neither a file nor a folder; refusing to copy it")
            out.append((p.relative_to(src), real))
    return out


def copy_tree(src: str | Path, dst: str | Path, ignore: Callable | None = None, what: str = "") -> None:
    """Copy the folder `src` to `dst` as `tree_files` finds it (checked whole before the first file is copied)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for rel, real in tree_files(src, ignore, what):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real, dst / rel)
