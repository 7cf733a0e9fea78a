"""The model pairs shipped in toolkit/data: the trained tiny pair (the CPU default of every command)."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError

DATA = Path(__file__).resolve().parent.parent / "data"
PAIR = DATA / "tiny_pair"
ARCHS = ("llama", "qwen3", "qwen3_5_moe")      # target families of the random fixtures (assets/fixtures.py)


def tiny_pair() -> tuple[Path, Path]:
    """The trained tiny pair shipped with the package: (target folder, drafter folder)."""
    t, d = PAIR / "target", PAIR / "draft"
    if not (t / "config.json").exists() or not (d / "config.json").exists():
        raise ToolkitError(f"{PAIR}: the trained tiny pair is missing; rebuild it with `python -m toolkit.tiny_pair`")
    return t, d
