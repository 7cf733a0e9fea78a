"""The one place a backend is chosen and built: `load_backend(name, target, draft, ...)`.

generate, bench, eval_tau and the app all build through it: the registry (runtime/registry.py) names the backends,
and each backend's `load` takes the common arguments and refuses what it cannot use, so a consumer passes what it
knows and never branches on the backend's name to build it.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from ..core.refs import fetch
from ..mtp import is_mtp
from .backend import Backend
from .registry import BACKENDS, backend_class, check_for_backend


def local(model: str | Path | None, what: str) -> str | Path | None:
    """A model as a local folder: a path as it is, a Hub ref `USER/NAME[@REVISION]` fetched at that revision."""
    if model is None or Path(model).expanduser().exists() or str(model).startswith(("/", ".", "~")):
        return model
    return fetch(model, what)[0]


def load_backend(name: str, target: str | Path, draft: str | Path | None = None, *, device: str = "cpu", dtype=None,
                 cache_tokens: int = 32768, max_concurrency: int = 32, options=None, split=None,
                 max_chunk: int | None = None) -> Backend:
    """The named backend (runtime/registry.py) over a target and an optional DFlash drafter: local folders, or Hub
    refs `USER/NAME[@REVISION]` (a branch such as `4.0bpw`, a tag or a sha) fetched through core.refs; `draft`
    "mtp" drafts with the target's own MTP head. The pair is read and checked once (runtime/pair.py) and handed to
    the backend.

    torch takes `device` and `dtype` (a torch.dtype; None = float32); exllamav3 runs on the GPU and takes
    `cache_tokens` (its paged cache, a multiple of 256), `max_concurrency` (jobs decoded together), `options`
    (exl3.options.Exl3Options: its generator levers; None = the adopted ones), `split` (placement.GpuSplit: the
    target across GPUs, the drafter's device; None = all on GPU 0) and `max_chunk` (the longest forward the caller
    runs, a multiple of 256; None = exllamav3's 2048). A backend refuses what it cannot take, never ignores it.
    """
    from .pair import ModelPair                   # imported on use: --help loads no torch

    mtp = is_mtp(draft)
    cls = backend_class(name, mtp)
    check_for_backend(name, split)
    target, draft = local(target, "target"), draft if mtp else local(draft, "draft")
    for flag, p in (("--target", target), ("--draft", None if mtp else draft)):
        if p is not None and not Path(p).is_dir():
            raise ToolkitError(f"{flag}: {p} is not a folder")
    return cls.load(ModelPair.read(target, draft), device=device, dtype=dtype, cache_tokens=cache_tokens,
                    max_concurrency=max_concurrency, options=options, split=split, max_chunk=max_chunk)
