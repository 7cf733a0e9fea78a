"""Swap the DFlash drafter of a loaded exllamav3 backend; the target, its cache and its placement stay loaded.

exllamav3 1.6.5 ties a drafter to the target only through the Generator (which attaches the drafter and asks the
target for the tapped states per forward) and, in the layer-split loader, through the tapped layers' budget
(`export_state_layers`: the same for every drafter of one target and block size). So the swap retires the
Generator, unloads the old drafter (its cache's tensors go with it), and loads the new one with a fresh cache of
the same size on the same device, through `backend.load_drafter` as the first load; the next generate builds a new
Generator. The quantize speed step measures every bitrate this way against one load of the target (an 18.4 GB
Qwen3.6-35B-A3B target loads in about 22 s).
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from ..core.target import TargetInfo
from ..runtime import placement
from .backend import Exl3Backend
from .loading import load_drafter, load_failure
from .draft_levers import set_draft_levers
from .options import Exl3Options
from .taps import free_gpu


def swap_draft(be: Exl3Backend, draft: str | Path) -> None:
    """Replace `be`'s drafter by the one in `draft` (EXL3 or BF16 layout) with the same block size. Cost tables
    and policies start over. One-line errors: a drafter that does not fit is refused before anything is unloaded;
    one that fails to load leaves the backend without a drafter (close it)."""
    from ..dflash import DFlashConfig

    draft = Path(draft)
    if be.draft is None:
        raise ToolkitError("swap_draft: this backend was loaded without a drafter")
    conf = DFlashConfig.from_dir(draft)
    try:
        conf.validate_against(TargetInfo.read(be.folders[0]).config)
    except ToolkitError as e:
        raise ToolkitError(f"drafter {draft} does not fit target {be.folders[0]}: {e}") from None
    if conf.block_size != be.block_size:      # the target cache's history was sized for the first drafter's block
        raise ToolkitError(f"drafter {draft} has block size {conf.block_size}, the loaded one {be.block_size}: "
                           "load a new backend for it")
    engine = be.engine
    engine.retire()                           # the Generator holds the old drafter and its cache
    engine.draft.unload()
    engine.draft = engine.draft_cache = None
    free_gpu()                                # the old drafter's memory back before the new one loads
    try:
        model, cache = load_drafter(engine.exl, draft, engine.cache_tokens, engine.max_concurrency,
                                    max(conf.block_size - 1, 1), be.split, placement.device_count())
    except Exception as e:
        kind, why = load_failure(e) or (None, None)
        if kind == "memory":
            raise ToolkitError(f"not enough GPU memory: ran out while loading drafter {draft}, {why} GiB free now") from None
        if kind == "load":
            raise ToolkitError(f"exllamav3 cannot load drafter {draft}: {why}") from None
        raise
    engine.draft, engine.draft_cache = model, cache
    set_draft_levers(model, be.options, Exl3Options(), be.draft_classes)   # the new drafter gets the options' wraps
    be.folders = (be.folders[0], draft)
    be.book.clear()                           # measured for the old pair, and its acceptance
