"""The one place a backend is chosen and built: `load_backend(name, target, draft, ...)`.

generate, bench, eval_tau and the app all build through it: the registry (runtime/registry.py) names the backends,
and each backend's `load` takes the common arguments and refuses what it cannot use, so a consumer passes what it
knows and never branches on the backend's name to build it. The folders are read and checked before the backend
(and torch) is imported: a missing folder, a drafter given as the target or a truncated file is refused at once.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from ..core.kinds import DFLASH, HF, require
from ..core.refs import fetch
from ..mtp import is_mtp
from .backend import Backend
from .pair import ModelPair
from .registry import BACKENDS, backend_class, capabilities, check_for_backend


def local(model: str | Path | None, what: str) -> str | Path | None:
    """A model as a local folder: a path as it is, a Hub ref `USER/NAME[@REVISION]` fetched at that revision."""
    if model is None or Path(model).expanduser().exists() or str(model).startswith(("/", ".", "~")):
        return model
    return fetch(model, what)[0]


def read_pair(name: str, target: str | Path, draft: str | Path | None = None, split=None) -> ModelPair:
    """The pair `load_backend` loads, read and checked without importing the backend or torch: the backend's name and
    `split`, both folders (Hub refs fetched), their configs and headers (runtime/pair.py), and for a backend that takes
    unquantized folders only, their kinds (core.kinds; its loaders ask again, the drafter first)."""
    mtp = is_mtp(draft)
    caps = capabilities(name)
    check_for_backend(name, split)
    target, draft = local(target, "target"), draft if mtp else local(draft, "draft")
    for flag, p in (("--target", target), ("--draft", None if mtp else draft)):
        if p is not None and not Path(p).is_dir():
            raise ToolkitError(f"{flag}: {p} is not a folder")
    pair = ModelPair.read(target, draft)
    if caps.unquantized:
        for folder, want, flag, info in ((pair.draft, DFLASH, "--draft", None), (pair.target, HF, "--target", pair.info)):
            if folder is not None:
                require(folder, want, flag, info)
    return pair


def load_backend(name: str, target: str | Path | ModelPair, draft: str | Path | None = None, *, device: str = "cpu",
                 dtype=None, cache_tokens: int = 32768, max_concurrency: int = 32, options=None, split=None,
                 max_chunk: int | None = None) -> Backend:
    """The named backend (runtime/registry.py) over a target and an optional DFlash drafter: local folders, or Hub
    refs `USER/NAME[@REVISION]` (a branch such as `4.0bpw`, a tag or a sha) fetched through core.refs; `draft`
    "mtp" drafts with the target's own MTP head. The pair is read and checked once (`read_pair`; `target` may be the
    pair it returned, read before the caller imported torch) and handed to the backend.

    torch takes `device` and `dtype` (a torch.dtype; None = float32); exllamav3 runs on the GPU and takes
    `cache_tokens` (its paged cache, a multiple of 256), `max_concurrency` (jobs decoded together), `options`
    (exl3.options.Exl3Options: its generator levers; None = the adopted ones), `split` (placement.GpuSplit: the
    target across GPUs, the drafter's device; None = all on GPU 0) and `max_chunk` (the longest forward the caller
    runs, a multiple of 256; None = exllamav3's 2048). A backend refuses what it cannot take, never ignores it.
    """
    pair = target if isinstance(target, ModelPair) else read_pair(name, target, draft, split)
    return backend_class(name, pair.mtp is not None).load(pair, device=device, dtype=dtype, cache_tokens=cache_tokens,
                                                          max_concurrency=max_concurrency, options=options, split=split,
                                                          max_chunk=max_chunk)
