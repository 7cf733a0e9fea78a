"""Resolve --model / --target: a local folder as is, a Hub id through snapshot_download at the pinned revision."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.target import TargetInfo


def is_local(ref: str | Path) -> bool:
    return Path(ref).expanduser().is_dir()


def looks_like_hub_id(ref: str) -> bool:
    parts = str(ref).split("/")
    return len(parts) == 2 and all(parts) and not str(ref).startswith((".", "/", "~"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def resolve(ref: str, revision: str | None = None, what: str = "model", config_only: bool = False,
            cache_only: bool = False) -> Path:
    """A local folder for `ref`. config_only fetches just config.json; cache_only never touches the network."""
    if is_local(ref):
        return Path(ref).expanduser().resolve()
    if not looks_like_hub_id(ref):
        raise ToolkitError(f"--{what}: {ref!r} is neither a local folder nor a Hub id (owner/name)")
    from huggingface_hub import snapshot_download

    local_only = cache_only or offline()
    patterns = ["config.json"] if config_only else None
    try:
        path = snapshot_download(ref, revision=revision, allow_patterns=patterns, local_files_only=local_only)
    except Exception as e:  # offline, missing revision, auth: huggingface_hub raises several types
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if local_only or "connect" in reason.lower() or "offline" in reason.lower() or "resolve" in reason.lower():
            raise ToolkitError(
                f"--{what}: cannot fetch {ref}@{revision or 'main'} (offline or no network: HF_HUB_OFFLINE="
                f"{os.environ.get('HF_HUB_OFFLINE', '0')}); pass a local folder with --{what} instead"
            ) from None
        raise ToolkitError(f"--{what}: cannot fetch {ref}@{revision or 'main'} ({reason})") from None
    return Path(path)


def target_kind(cfg: dict) -> str:
    """'exl3' for an exllamav3 model, else 'hf' (a transformers checkpoint, BF16 or otherwise)."""
    return "exl3" if TargetInfo(cfg).exl3 else "hf"
