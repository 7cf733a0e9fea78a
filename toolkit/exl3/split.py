"""exllamav3's load arguments for a placement (runtime/placement.py's GpuSplit): the target on one GPU, split
across several (`use_per_device`, `reserve_per_device`) or tensor-parallel (`tensor_p`), the drafter on one device.
The drafter is loaded first (as exllamav3's own model_init does), so a target budget is on top of the drafter.
exllamav3's use/reserve budgets count from what is already allocated on a device when the target loads.
"""

from __future__ import annotations

from ..runtime.placement import GpuSplit

RESERVE_GB = 0.5                     # exllamav3's default reserve per device (model.load_gen)


def target_load_kwargs(split: GpuSplit, count: int) -> dict:
    """exllamav3 Model.load arguments that place the target (on top of progressbar and draft_model)."""
    s = split.gpu_split
    if isinstance(s, tuple):
        kw: dict = {"use_per_device": list(s)}
    elif s == "auto" or split.tensor_parallel:
        kw = {"reserve_per_device": [RESERVE_GB] * count}
    else:
        kw = only_device(0, count)
    if split.tensor_parallel:
        kw["tensor_p"] = True
    return kw


def draft_load_kwargs(split: GpuSplit, count: int) -> dict:
    """exllamav3 Model.load arguments that keep the drafter on the split's `draft_device` (layer-split loader, one device)."""
    return only_device(split.draft_device, count)


def only_device(device: int, count: int) -> dict:
    """Autosplit onto one device: the others get a negative reserve (exllamav3 leaves them out). On a machine with
    one GPU and device 0 nothing is passed: exllamav3's own default, as the backend always loaded."""
    if count <= 1 and device == 0:
        return {}
    return {"reserve_per_device": [RESERVE_GB if i == device else -1 for i in range(max(count, device + 1))]}
