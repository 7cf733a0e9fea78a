"""Loading exllamav3 models for the backend: the GPU check, the seam-checked import, both models and their caches
placed by the split, and what a failed load means."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import ToolkitError
from . import seams
from .memory import GIB
from ..runtime.placement import GpuSplit
from .split import draft_load_kwargs, target_load_kwargs

MIN_CAPABILITY = (8, 0)
LOAD_CHUNK = 2048       # exllamav3 1.6.5 Model.load's default max_chunk_size


def check_cuda() -> str:
    """The GPU's name, or a one-line ToolkitError saying which GPU the backend needs."""
    import torch

    need = f"an NVIDIA GPU with CUDA, compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ampere, Ada, Hopper, Blackwell)"
    if not torch.cuda.is_available():
        raise ToolkitError(f"no CUDA GPU found: the exllamav3 backend needs {need}; use --backend torch on CPU")
    name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    if tuple(cap) < MIN_CAPABILITY:
        raise ToolkitError(f"{name} has compute capability {cap[0]}.{cap[1]}: the exllamav3 backend needs {need}")
    return name


def import_exllamav3():
    """exllamav3's public classes, after checking that every seam the toolkit touches is there (its import builds
    or loads the CUDA extension)."""
    from types import SimpleNamespace

    seams.require()
    return SimpleNamespace(**{n: seams.get(n) for n in ("Config", "Model", "Cache", "Tokenizer", "Generator", "Job")})


FIRST_LOAD: dict[str, str | None] = {}   # EXL3_GRAPHS as the process's first exllamav3 load saw it


def note_graphs_mode() -> None:
    """Remember EXL3_GRAPHS at the first load: exllamav3's extension reads it once, when it builds its first graph."""
    FIRST_LOAD.setdefault("EXL3_GRAPHS", os.environ.get("EXL3_GRAPHS"))


def settle_graphs_mode(forward_graphs: bool) -> None:
    """Before the process's first exllamav3 load: with whole-forward graphs wanted and EXL3_GRAPHS unset, turn
    exllamav3's own graphs off (they cannot run inside a capture; the replay holds the same kernels)."""
    if forward_graphs and not FIRST_LOAD and "EXL3_GRAPHS" not in os.environ:
        os.environ["EXL3_GRAPHS"] = "0"


def exl3_graphs_blocker() -> str | None:
    """Why whole-forward graphs cannot be captured in this process (exllamav3's own graphs are on), or None."""
    if FIRST_LOAD.get("EXL3_GRAPHS", os.environ.get("EXL3_GRAPHS")) == "0":
        return None
    return "exllamav3's own CUDA graphs are on (start the process with EXL3_GRAPHS=0)"


def load_chunk(cache_tokens: int, max_chunk: int | None = None) -> dict:
    """Load kwargs for a cache of `cache_tokens`. Model.load's layer-split loader runs its measuring forward over a
    (1, max_chunk_size) batch shape in the cache (exllamav3 modules/attn.py asserts max_chunk_size <=
    cache.max_num_tokens, "Cache too small for batch shape"); its default chunk is 2048, so a smaller cache (the
    quantize speed step sizes it to one job) loads with the chunk cut to the cache, and `max_chunk` (the longest
    forward a caller runs) cuts it further. Otherwise the load takes exllamav3's defaults, as always."""
    chunk = min(cache_tokens, max_chunk or LOAD_CHUNK)
    return {"max_chunk_size": chunk} if chunk < LOAD_CHUNK else {}


def load_drafter(exl, draft: Path, cache_tokens: int, max_concurrency: int, history: int, split: GpuSplit,
                 count: int) -> tuple:
    """(drafter, drafter cache): its cache made before its load, the load on split's drafter device, then checked
    for the attributes the toolkit reads (seams.check_loaded)."""
    note_graphs_mode()
    dmodel = exl.Model.from_config(exl.Config.from_directory(str(draft)))
    dcache = exl.Cache(dmodel, max_num_tokens=cache_tokens, max_batch_size=max_concurrency, max_history=history)
    dmodel.load(progressbar=False, **draft_load_kwargs(split, count), **load_chunk(cache_tokens))
    seams.check_loaded(dmodel, dcache)
    return dmodel, dcache


def load_mtp(exl, config, target: Path, cache_tokens: int, max_concurrency: int, history: int, split: GpuSplit,
             count: int) -> tuple:
    """(MTP head, its cache): the target's own MTP component, built from the target's config as exllamav3 builds it
    for `--mtp`, its cache made before its load, the load on split's drafter device."""
    if "mtp" not in (getattr(config, "model_classes", None) or {}):
        arch = getattr(config, "architecture", None) or "this architecture"
        raise ToolkitError(f"--draft mtp: exllamav3 has no MTP drafter for {target} ({arch}); it drafts with the MTP head "
                           "of Qwen3.5 / Qwen3.6 checkpoints in their multimodal layout (Qwen3_5MoeForConditionalGeneration)")
    dmodel = exl.Model.from_config(config, component="mtp")
    dcache = exl.Cache(dmodel, max_num_tokens=cache_tokens, max_batch_size=max_concurrency, max_history=history)
    dmodel.load(progressbar=False, **draft_load_kwargs(split, count), **load_chunk(cache_tokens))
    return dmodel, dcache


def load_models(exl, target: Path, draft: Path | None, cache_tokens: int, max_concurrency: int, history: int,
                split: GpuSplit, count: int, max_chunk: int | None = None, mtp: bool = False) -> tuple:
    """(model, cache, drafter, drafter cache) loaded by exllamav3: every cache before any load, the drafter first
    on its device, then the target placed by the split (per-device budgets, autosplit or tensor-parallel; with the
    drafter passed so the layer-split loader budgets for the states it taps; its chunk cut to `max_chunk`); each
    model checked for the attributes the toolkit reads (seams.check_loaded). With `mtp`
    the drafter is the target's own MTP head."""
    note_graphs_mode()
    config = exl.Config.from_directory(str(target))
    model = exl.Model.from_config(config)
    cache = exl.Cache(model, max_num_tokens=cache_tokens, max_batch_size=max_concurrency, max_history=history)
    dmodel = dcache = None
    if mtp:
        dmodel, dcache = load_mtp(exl, config, target, cache_tokens, max_concurrency, history, split, count)
    elif draft is not None:
        dmodel, dcache = load_drafter(exl, draft, cache_tokens, max_concurrency, history, split, count)
    model.load(progressbar=False, **target_load_kwargs(split, count), **load_chunk(cache_tokens, max_chunk),
               **({"draft_model": dmodel} if dmodel is not None else {}))
    seams.check_loaded(model, cache)
    return model, cache, dmodel, dcache


def load_failure(e: Exception) -> tuple[str, str] | None:
    """What an exception from an exllamav3 load means: ("memory", GiB free now) when the GPU ran out, ("load", its
    first line) for exllamav3's known refusals, None for anything else (a bug: let it raise)."""
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return "memory", f"{torch.cuda.mem_get_info()[0] / GIB:.1f}"
    known = isinstance(e, (AssertionError, ValueError, KeyError, OSError, NotImplementedError))
    if known or (isinstance(e, RuntimeError) and "VRAM" in str(e)):        # "Insufficient VRAM in split ..."
        return "load", str(e).splitlines()[0] if str(e) else type(e).__name__
    return None
