"""The cache of timed cost tables: one JSON file per model pair, device, dtype and block size.

A table is cached only when it holds together: one that contradicts itself (a narrower width dearer than a wider
one: the load moved while it was timed) is timed again, up to TRIES times, and kept out of the cache if it still
does (and the file it replaces is removed). A cached table is timed again when it contradicts itself, lacks the
rounds behind its values (an older cache), or disagrees with a few rounds timed now; and it leaves the cache when
the live AR rounds run far cheaper (the policy's cost book, book.py), so the next start times it again."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.files import Num, number_table, read_json
from ..core.folders import atomic_file, cache_root
from .table import NOISE_MS, STALE, CostTable

COST_CACHE_ENV = "DFLASH_COST_CACHE"   # a folder that replaces ~/.cache/dflash-toolkit/costs
TRIES = 2          # timings of a table that contradicts itself before it is used uncached


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
    """The table cached under `key`, or a fresh `measure()` saved there (module docstring): a broken, foreign or
    self-contradicting file is re-timed, and so is one that `check()` ({concurrency: {width: ms}}, a few widths
    timed now) finds off by more than STALE (the machine's load or settings changed since)."""
    path = Path(folder or cost_dir()) / f"{key}.json"
    cached = None
    if path.is_file() and not refresh:
        try:
            d = read_json(path, "cost cache", limit=1 << 20)
            ms = number_table(d.get("ms"), (Num(1, 4096, "jobs", whole=True), Num(0, 4096, "drafts", whole=True)),
                              Num(0, 1e9, "ms", above=True), str(path), "ms")   # out of range: re-timed below
            cached = CostTable.from_json({**d, "ms": ms}, f"cached {path}")
            if "rounds" not in d or cached.contradiction():        # an older cache, or timed while the load moved
                cached = None
        except (ToolkitError, ValueError, KeyError, TypeError, AttributeError):
            pass                                 # broken or foreign: time it again and overwrite
    why = stale(cached, check()) if cached is not None and check is not None else ""
    if cached is not None and not why:
        cached.on_disagree = lambda c, why: forget(path)
        return cached
    for _ in range(TRIES):
        table = measure()
        if not (odd := table.contradiction()):
            break
    table.timed_at = table.timed_at or time.time()
    if odd:
        table.source = f"timed now, not cached: {odd} in {TRIES} timings"
        forget(path)                             # nor is a broken or stale file left for the next start
        return table
    table.source = f"timed now ({why})" if why else "timed now"
    try:
        atomic_file(path, json.dumps(table.to_json(), indent=1))
        table.on_disagree = lambda c, why: forget(path)
    except (OSError, ToolkitError):
        pass                                     # a read-only or full cache only costs a re-timing next time
    return table


def forget(path: Path) -> None:
    """Remove a cached table the live rounds disagree with: the next start times it again."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def stale(table: CostTable, now: dict[int, dict[int, float]]) -> str:
    """Why a cached table no longer holds against {concurrency: {width: ms}} timed now ("" when it does)."""
    for c, pts in sorted(now.items()):
        cached = table.ms.get(c, {})
        for w, t in sorted(pts.items()):
            if w in cached and not 1 / STALE <= cached[w] / t <= STALE and abs(cached[w] - t) >= NOISE_MS:
                return f"the cached {'AR step' if w == 0 else f'{w}-draft round'} took {cached[w]:.3g} ms, now {t:.3g} ms"
    return ""
