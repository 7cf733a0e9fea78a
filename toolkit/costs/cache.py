"""The cache of timed cost tables: one JSON file per model pair, device, dtype and block size."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterable
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.files import Num, number_table, read_json
from ..core.folders import atomic_file, cache_root
from .table import CostTable

COST_CACHE_ENV = "DFLASH_COST_CACHE"   # a folder that replaces ~/.cache/dflash-toolkit/costs
STALE = 1.5        # a cached width's ms over (or under) today's by more than this: the table is timed again
NOISE_MS = 2.0     # unless they differ by less than this (sub-ms rounds of tiny models time noisily)


def device_name(device) -> str:
    """The accelerator's name, or the CPU's with its thread count (both change round costs)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()}"


def cost_key(folders: Iterable[str | Path], device, dtype, block_size: int) -> str:
    """Cache key: the model folders' config.json hash, the device name, the dtype and the block size."""
    h = hashlib.sha256()
    for f in folders:
        p = Path(f) / "config.json"
        h.update(p.read_bytes() if p.is_file() else str(f).encode())
    h.update(f"|{device_name(device)}|{dtype}|{block_size}".encode())
    return h.hexdigest()[:20]


def cost_dir() -> Path:
    """Where timed tables live: $DFLASH_COST_CACHE, else $XDG_CACHE_HOME or ~/.cache /dflash-toolkit/costs."""
    if os.environ.get(COST_CACHE_ENV):
        return Path(os.environ[COST_CACHE_ENV])
    return cache_root() / "costs"


def cached_costs(key: str, measure: Callable[[], CostTable], folder: str | Path | None = None,
                 refresh: bool = False, check: Callable[[], dict[int, dict[int, float]]] | None = None) -> CostTable:
    """The table cached under `key`, or a fresh `measure()` saved there; a broken or foreign file is re-timed, and
    so is one that `check()` ({concurrency: {width: ms}}, a few widths timed now) finds off by more than STALE (the
    machine's load or settings changed since: the policy corrects the widths it runs, never one it stopped running)."""
    path = Path(folder or cost_dir()) / f"{key}.json"
    cached = None
    if path.is_file() and not refresh:
        try:
            d = read_json(path, "cost cache", limit=1 << 20)
            ms = number_table(d.get("ms"), (Num(1, 4096, "jobs", whole=True), Num(0, 4096, "drafts", whole=True)),
                              Num(0, 1e9, "ms", above=True), str(path), "ms")   # out of range: re-timed below
            cached = CostTable.from_json({**d, "ms": ms}, f"cached {path}")
        except (ToolkitError, ValueError, KeyError, TypeError, AttributeError):
            pass                                 # broken or foreign: time it again and overwrite
    why = stale(cached, check()) if cached is not None and check is not None else ""
    if cached is not None and not why:
        return cached
    table = measure()
    table.source = f"timed now ({why})" if why else "timed now"
    try:
        atomic_file(path, json.dumps(table.to_json(), indent=1))
    except (OSError, ToolkitError):
        pass                                     # a read-only or full cache only costs a re-timing next time
    return table


def stale(table: CostTable, now: dict[int, dict[int, float]]) -> str:
    """Why a cached table no longer holds against {concurrency: {width: ms}} timed now ("" when it does)."""
    for c, pts in sorted(now.items()):
        cached = table.ms.get(c, {})
        for w, t in sorted(pts.items()):
            if w in cached and not 1 / STALE <= cached[w] / t <= STALE and abs(cached[w] - t) >= NOISE_MS:
                return f"the cached {'AR step' if w == 0 else f'{w}-draft round'} took {cached[w]:.3g} ms, now {t:.3g} ms"
    return ""
