"""The policy replay's table, cached by what it depends on.

The replay (tests/replay_table.py) is deterministic: the same sources and the same committed traces give the same
table. So its cells are kept in a tracked file, tests/data/replay/table.json, with the sha256 of everything the
replay reads: the first-party modules tests/replay_table.py and tests/replay_rivals.py import, at any depth (the
policy, its cost model, the replay's rivals), every committed input of tests/data/replay/ (traces' costs and the
drafter's lengths), and the seeds and repetitions. A clean clone whose sources match reads the table in
milliseconds; any change to one of those files is a mismatch, and the slow test replays again and requires the
same table (tests/slow/test_policy_replay.py). `python -m experiments.policy_replay table --write` refreshes the
cache, the full table (tests/data/replay/table.md) and prints the results page's summary.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from tests import replay_table as T

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "replay"
CACHE, FULL = DATA / "table.json", DATA / "table.md"
SEEDS, REPS = 16, 10                       # the results page's table: 16 cost draws, 10 repetitions each
ENTRIES = (ROOT / "tests" / "replay_table.py", ROOT / "tests" / "replay_rivals.py")


def module_files(name: str) -> list[Path]:
    """The files importing `name` executes in this tree: each package's __init__.py on the way and the module."""
    parts = name.split(".")
    if parts[0] not in ("toolkit", "tests"):
        if not (ROOT / "tests" / f"{parts[0]}.py").is_file():        # a helper of tests/ by its bare name, or not ours
            return []
        parts = ["tests", *parts]
    out, base = [], ROOT
    for part in parts:
        base = base / part
        if (base / "__init__.py").is_file():
            out.append(base / "__init__.py")
        elif base.with_suffix(".py").is_file():
            out.append(base.with_suffix(".py"))
            break
        elif not base.is_dir():
            break
    return out


def sources(entries: tuple[Path, ...] = ENTRIES) -> list[Path]:
    """`entries` and every first-party file they import, at any depth (lazy imports count)."""
    seen: set[Path] = set()
    todo = list(entries)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        package = ".".join(path.relative_to(ROOT).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                todo += module_files(n)
    return sorted(seen)


def inputs() -> list[Path]:
    """The sources and the committed data the table depends on (the cache and the full table aside)."""
    return sources() + sorted(p for p in DATA.iterdir() if p.suffix == ".gz")


def digest(files: list[Path] | None = None, seeds: int = SEEDS, reps: int = REPS) -> str:
    h = hashlib.sha256(f"seeds={seeds} reps={reps}\n".encode())
    for p in files if files is not None else inputs():
        h.update(f"{p.relative_to(ROOT).as_posix()}\n".encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def to_json(cells: T.Cells) -> dict:
    return {f"{n} c={c}": {m: v if m == "best" else list(v) for m, v in cell.items()} for (n, c), cell in cells.items()}


def from_json(data: dict) -> T.Cells:
    out: T.Cells = {}
    for key, cell in data.items():
        name, c = key.rsplit(" c=", 1)
        out[(name, int(c))] = {m: v if m == "best" else tuple(v) for m, v in cell.items()}
    return out


def stored() -> dict | None:
    """The tracked cache: {"sha256", "seeds", "reps", "cells"}; None when there is none."""
    return json.loads(CACHE.read_text()) if CACHE.is_file() else None


def fresh_cells() -> T.Cells | None:
    """The cached cells when their hash is the present inputs' hash, else None (the replay must run)."""
    data = stored()
    return from_json(data["cells"]) if data and data["sha256"] == digest() else None


def write(cells: T.Cells, rows: dict[str, str]) -> None:
    """The cache and the full table, for the present inputs."""
    data = {"sha256": digest(), "seeds": SEEDS, "reps": REPS, "cells": to_json(cells)}
    CACHE.write_text(json.dumps(data, indent=1) + "\n")
    FULL.write_text(full_table(cells, rows))


def full_table(cells: T.Cells, rows: dict[str, str]) -> str:
    return ("# The policy replay's table\n\nGenerated by `python -m experiments.policy_replay table --write` "
            f"({SEEDS} cost draws x {REPS} repetitions; docs/results.md gives its summary and reads it).\n\n"
            + T.markdown(cells, rows) + "\n")
