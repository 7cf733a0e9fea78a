"""What a round costs: ms per round {concurrency: {verify width: ms}}, w = 0 the AR step, timed once per model
pair and device (cache.py), each value with the rounds it is the median (or low quartile) of and the time it was
timed. The policy decides at the timed widths; projections and reports read the curve over every width, linear
between timed widths and made non-decreasing. A table contradicts itself when a narrower width costs more than
ORDER times a wider one (the AR step included): the load moved while it was timed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

STALE = 1.5        # two costs that differ by more than this factor disagree (cache.py, the policy's cost book)
NOISE_MS = 2.0     # unless they differ by less than this (sub-ms rounds of tiny models time noisily)
ORDER = 1.25       # a narrower width dearer than a wider one by more than this: the table contradicts itself


@dataclass
class CostTable:
    """Timed ms per round: {concurrency: {verify width w: ms}}, w = 0 the AR step; `source` says where it came from."""

    ms: dict[int, dict[int, float]]
    device: str = ""
    source: str = field(default="given", compare=False)
    counts: dict[int, dict[int, int]] = field(default_factory=dict, compare=False)   # rounds behind each value
    timed_at: float | None = field(default=None, compare=False)                      # time.time() of the timing
    on_disagree: Callable[[int, str], None] | None = field(default=None, repr=False, compare=False)
    near: dict[tuple[int, int], int] = field(default_factory=dict, init=False, repr=False, compare=False)
    told: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.ms = {int(c): {int(w): float(t) for w, t in pts.items()} for c, pts in self.ms.items()}
        if not self.ms:
            raise ValueError("cost table is empty")
        for c, pts in self.ms.items():
            if c < 1 or 0 not in pts or not any(w > 0 for w in pts):
                raise ValueError(f"concurrency {c}: need the AR cost (w=0) and at least one width > 0")
            if any(w < 0 or not (math.isfinite(t) and 0 < t < 1e9) for w, t in pts.items()):
                raise ValueError(f"concurrency {c}: widths must be >= 0 and costs finite, > 0 and < 1e9 ms")

    def near_key(self, concurrency: int = 1) -> int:
        """The timed concurrency nearest `concurrency` (ties: the lower one)."""
        key = (concurrency, len(self.ms))              # a table only gains concurrencies
        if key not in self.near:
            self.near[key] = min(self.ms, key=lambda c: (abs(c - concurrency), c))
        return self.near[key]

    def nearest(self, concurrency: int = 1) -> dict[int, float]:
        """{w: ms} of the timed concurrency nearest `concurrency` (ties: the lower one)."""
        return self.ms[self.near_key(concurrency)]

    def contradiction(self) -> str:
        """Why this table contradicts itself ("" when it does not): a narrower width dearer than a wider one."""
        for c, pts in sorted(self.ms.items()):
            ws = sorted(pts)
            for i, a in enumerate(ws):
                for b in ws[i + 1:]:
                    if pts[a] > ORDER * pts[b] and pts[a] - pts[b] >= NOISE_MS:
                        return f"{round_name(a)} took {pts[a]:.3g} ms, more than {round_name(b)} ({pts[b]:.3g} ms)"
        return ""

    def disagrees(self, concurrency: int, why: str) -> None:
        """The live rounds at `concurrency` say this table was timed under other load: its source says so, and its
        cache is told (the next start times it again); once per concurrency."""
        if concurrency in self.told:
            return
        self.told.add(concurrency)
        self.source += f"; {why}: scaled to them"
        if self.on_disagree is not None:
            self.on_disagree(concurrency, why)

    def curve(self, block_size: int, concurrency: int = 1) -> list[float]:
        """t_round(w) for w = 0..block_size-1: linear between timed widths, non-decreasing, never below AR."""
        pts = self.nearest(concurrency)
        spec = monotone([(w, t, 1) for w, t in sorted(pts.items()) if w > 0])
        out = [pts[0]]
        for w in range(1, block_size):
            out.append(max(out[-1], interpolate(spec, w)))
        return out

    def to_json(self) -> dict:
        return {"device": self.device, "timed_at": self.timed_at,
                "ms": {str(c): {str(w): t for w, t in sorted(p.items())} for c, p in sorted(self.ms.items())},
                "rounds": {str(c): {str(w): n for w, n in sorted(p.items())} for c, p in sorted(self.counts.items())}}

    @classmethod
    def from_json(cls, d: dict, source: str = "given") -> CostTable:
        counts = {int(c): {int(w): int(n) for w, n in p.items()} for c, p in (d.get("rounds") or {}).items()}
        return cls(ms=d["ms"], device=str(d.get("device", "")), source=source, counts=counts,
                   timed_at=float(d["timed_at"]) if d.get("timed_at") is not None else None)


def round_name(w: int) -> str:
    return "the AR step" if w == 0 else f"the {w}-draft round"


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


def as_ms(curve: Iterable[float]) -> dict[int, float]:
    return {w: round(float(t), 3) for w, t in enumerate(curve)}
