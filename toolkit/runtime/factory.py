"""The one place a backend is chosen and built: `load_backend("torch" | "exllamav3", target, draft, ...)`.

generate, bench, eval_tau and the app all build through it; which options reach which backend is decided
here, so a consumer passes what it knows and never branches on the backend's name to build it.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from ..core.refs import fetch
from .backend import Backend
from .gpu_split import check_for_backend

BACKENDS = ("torch", "exllamav3")


def local(model: str | Path | None, what: str) -> str | Path | None:
    """A model as a local folder: a path as it is, a Hub ref `USER/NAME[@REVISION]` fetched at that revision."""
    if model is None or Path(model).expanduser().exists() or str(model).startswith(("/", ".", "~")):
        return model
    return fetch(model, what)[0]


def load_backend(name: str, target: str | Path, draft: str | Path | None = None, *, device: str = "cpu", dtype=None,
                 cache_tokens: int = 32768, max_concurrency: int = 32, options=None, split=None,
                 max_chunk: int | None = None) -> Backend:
    """The named backend over a target and an optional DFlash drafter: local folders, or Hub refs
    `USER/NAME[@REVISION]` (a branch such as `4.0bpw`, a tag or a sha) fetched through core.refs.

    torch takes `device` and `dtype` (a torch.dtype; None = float32); exllamav3 runs on the GPU and takes
    `cache_tokens` (its paged cache, a multiple of 256), `max_concurrency` (jobs decoded together) and `options`
    (runtime.exl3_options.Exl3Options: its generator levers; None = all off) and `split`
    (runtime.gpu_split.GpuSplit: the target across GPUs, the drafter's device; None = all on GPU 0) and
    `max_chunk` (the longest forward the caller runs, a multiple of 256; None = exllamav3's 2048). torch takes no
    split and no max_chunk: they are refused, never ignored.
    """
    if name not in BACKENDS:
        raise ToolkitError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    target, draft = local(target, "target"), local(draft, "draft")
    for flag, p in (("--target", target), ("--draft", draft)):
        if p is not None and not Path(p).is_dir():
            raise ToolkitError(f"{flag}: {p} is not a folder")
    check_for_backend(name, split)
    if name == "torch":
        import torch

        if options is not None and options.tag != "stock":
            raise ToolkitError(f"exllamav3 generator options ({options.tag}) need --backend exllamav3")
        if max_chunk is not None:
            raise ToolkitError("max_chunk is an exllamav3 load option; the torch backend takes none")

        from .torch_backend import TorchBackend

        return TorchBackend.from_dirs(target, draft, device=device, dtype=dtype or torch.float32)
    from ..exl3.backend import Exl3Backend

    return Exl3Backend.from_dirs(target, draft, cache_tokens=cache_tokens, max_concurrency=max_concurrency,
                                 options=options, split=split, max_chunk=max_chunk)
