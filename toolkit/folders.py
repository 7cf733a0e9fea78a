"""Model folders: read a folder's config.json with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ToolkitError


def read_config(folder: str | Path, what: str | None = None) -> dict:
    """config.json of a model folder as a dict; `what` names the flag in errors (e.g. "model" -> "--model: ...")."""
    prefix = f"--{what}: " if what else ""
    p = Path(folder) / "config.json"
    if not p.is_file():
        raise ToolkitError(f"{prefix}{folder} has no config.json (not a model folder)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{prefix}{p} is not valid JSON ({e.msg} at line {e.lineno})") from None
