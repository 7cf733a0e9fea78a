"""What a round costs: a timed table, corrected by the rounds the decoder observes.

`CostTable` holds ms per round {concurrency: {verify width: ms}}, w = 0 the AR step, timed once per model pair and
device and cached as JSON. `RoundCosts` is what the policy decides by, at the table's widths: a width seen at least
MIN_SEEN times at a job count costs the median of its last KEEP rounds there, any other the table's value. A table
timed under other load, on another machine or by another version is corrected after a few rounds of each width.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.files import Num, number_table, read_json
from ..core.folders import atomic_file, cache_root

COST_CACHE_ENV = "DFLASH_COST_CACHE"   # a folder that replaces ~/.cache/dflash-toolkit/costs
KEEP = 32          # recent rounds kept per (jobs, width)
MIN_SEEN = 5       # rounds before a width's own rounds replace the table's value


@dataclass
class CostTable:
    """Timed ms per round: {concurrency: {verify width w: ms}}, w = 0 the AR step; `source` says where it came from."""

    ms: dict[int, dict[int, float]]
    device: str = ""
    source: str = field(default="given", compare=False)

    def __post_init__(self) -> None:
        self.ms = {int(c): {int(w): float(t) for w, t in pts.items()} for c, pts in self.ms.items()}
        if not self.ms:
            raise ValueError("cost table is empty")
        for c, pts in self.ms.items():
            if c < 1 or 0 not in pts or not any(w > 0 for w in pts):
                raise ValueError(f"concurrency {c}: need the AR cost (w=0) and at least one width > 0")
            if any(w < 0 or not (math.isfinite(t) and 0 < t < 1e9) for w, t in pts.items()):
                raise ValueError(f"concurrency {c}: widths must be >= 0 and costs finite, > 0 and < 1e9 ms")

    def nearest(self, concurrency: int = 1) -> dict[int, float]:
        """{w: ms} of the timed concurrency nearest `concurrency` (ties: the lower one)."""
        return self.ms[min(self.ms, key=lambda c: (abs(c - concurrency), c))]

    def curve(self, block_size: int, concurrency: int = 1) -> list[float]:
        """t_round(w) for w = 0..block_size-1: linear between timed widths, non-decreasing, never below AR."""
        pts = self.nearest(concurrency)
        spec = monotone([(w, t, 1) for w, t in sorted(pts.items()) if w > 0])
        out = [pts[0]]
        for w in range(1, block_size):
            out.append(max(out[-1], interpolate(spec, w)))
        return out

    def to_json(self) -> dict:
        return {"device": self.device, "ms": {str(c): {str(w): t for w, t in sorted(p.items())} for c, p in sorted(self.ms.items())}}

    @classmethod
    def from_json(cls, d: dict, source: str = "given") -> CostTable:
        return cls(ms=d["ms"], device=str(d.get("device", "")), source=source)


def interpolate(points: list[tuple[int, float]], w: int) -> float:
    """Piecewise-linear value at w through sorted (width, ms) points: flat below, last slope (>= 0) above."""
    if w <= points[0][0] or len(points) == 1:
        return points[0][1] if w <= points[0][0] else points[-1][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if w <= w1:
            return t0 + (t1 - t0) * (w - w0) / (w1 - w0)
    (w0, t0), (w1, t1) = points[-2], points[-1]
    return t1 + max(t1 - t0, 0.0) * (w - w1) / (w1 - w0)


def monotone(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """(width, ms) through sorted (width, ms, weight) points, made non-decreasing by pooling adjacent violators
    into their weighted mean (isotonic regression): one noisy width does not raise every wider one."""
    blocks: list[list] = []                              # [total weight, weighted sum, widths]
    for w, t, n in points:
        blocks.append([n, n * t, [w]])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] > blocks[-1][1] / blocks[-1][0]:
            n2, s2, w2 = blocks.pop()
            blocks[-1][0] += n2
            blocks[-1][1] += s2
            blocks[-1][2] += w2
    return [(w, s / n) for n, s, ws in blocks for w in ws]


class RoundCosts:
    """ms per round at the table's widths per job count: the table corrected by observed rounds (module docstring)."""

    def __init__(self, table: CostTable, learn: bool = True):
        self.table, self.learn = table, learn
        self.seen: dict[tuple[int, int], deque] = {}    # (jobs, width) -> its recent rounds' ms

    def observe(self, jobs: int, width: int, ms: float) -> None:
        """A round of `jobs` jobs verifying `width` drafts took `ms`."""
        if self.learn and width in self.table.nearest(jobs) and math.isfinite(ms) and ms > 0:
            self.seen.setdefault((jobs, width), deque(maxlen=KEEP)).append(ms)

    def curve(self, jobs: int) -> dict[int, float]:
        """{w: ms} at the table's widths for `jobs` jobs."""
        seen = self.seen.get
        return {w: statistics.median(seen((jobs, w))) if len(seen((jobs, w), ())) >= MIN_SEEN else t
                for w, t in self.table.nearest(jobs).items()}

    def report(self, block_size: int) -> dict:
        """{"start": {c: {w: ms}}, "learned": {c: {w: ms}}, "observed": {c: {w: rounds}}, "source": ...}: the
        curves for w = 0..B-1, interpolated between the table's widths (CostTable.curve)."""
        cs = sorted(set(self.table.ms) | {j for j, _ in self.seen})
        return {"source": self.table.source,
                "start": {c: as_ms(self.table.curve(block_size, c)) for c in cs},
                "learned": {c: as_ms(CostTable({c: self.curve(c)}).curve(block_size, c)) for c in cs},
                "observed": {c: {w: {"ms": round(self.curve(c)[w], 3), "rounds": len(d)}
                                 for (j, w), d in sorted(self.seen.items()) if j == c} for c in cs}}


def as_ms(curve: Iterable[float]) -> dict[int, float]:
    return {w: round(float(t), 3) for w, t in enumerate(curve)}


# -- the cache of timed tables -----------------------------------------------------------------------------------

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
                 refresh: bool = False) -> CostTable:
    """The table cached under `key`, or a fresh `measure()` saved there; a broken or foreign file is re-timed."""
    path = Path(folder or cost_dir()) / f"{key}.json"
    if path.is_file() and not refresh:
        try:
            d = read_json(path, "cost cache", limit=1 << 20)
            ms = number_table(d.get("ms"), (Num(1, 4096, "jobs", whole=True), Num(0, 4096, "drafts", whole=True)),
                              Num(0, 1e9, "ms", above=True), str(path), "ms")   # out of range: re-timed below
            return CostTable.from_json({**d, "ms": ms}, f"cached {path}")
        except (ToolkitError, ValueError, KeyError, TypeError, AttributeError):
            pass                                 # broken or foreign: time it again and overwrite
    table = measure()
    table.source = "timed now"
    try:
        atomic_file(path, json.dumps(table.to_json(), indent=1))
    except (OSError, ToolkitError):
        pass                                     # a read-only or full cache only costs a re-timing next time
    return table
