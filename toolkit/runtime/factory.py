"""One entry point for every consumer: `load_backend("torch" | "exllamav3", target, draft, **kw)`."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from .backend import Backend

BACKENDS = ("torch", "exllamav3")


def load_backend(backend: str, target: str | Path, draft: str | Path | None = None, **kw) -> Backend:
    """The named backend over a target folder and an optional DFlash drafter folder.

    Extra keywords go to the backend's from_dirs (torch: device, dtype; exllamav3: block_size, cache_tokens,
    max_concurrency); each backend ignores the ones it does not take.
    """
    if backend not in BACKENDS:
        raise ToolkitError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    for name, p in (("target", target), ("draft", draft)):
        if p is not None and not Path(p).is_dir():
            raise ToolkitError(f"{name}: {p} is not a folder")
    if backend == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend.from_dirs(target, draft, **kw)
    from .exl3_backend import Exl3Backend

    return Exl3Backend.from_dirs(target, draft, **kw)
