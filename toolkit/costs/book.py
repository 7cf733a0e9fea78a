"""The round costs the policy decides by, a book of (job count, width) -> ms, each cost with the rounds behind it
and their age (`RoundCosts.book`: what the app's page and bench.json show). A cost is a count and a median, never
one round:

- A width seen MIN_SEEN times at a job count costs the median of its last KEEP rounds there.
- Any other width costs the timed table's value (the median of the rounds its timing ran; exllamav3's, their low
  quartile). Where MIN_SEEN live AR rounds, at a job count the table timed, run STALE times cheaper than its AR
  step, the table was timed under heavier load: its values are scaled by live / timed AR and its cache drops it
  (cache.py: the next start times it again). A dearer live AR step is the moment's load (a slow stretch), which
  the cache's check at the next start sees. Replayed (tests/slow/test_policy_replay.py), scaling moves no `auto`
  cell of the device traces and lifts a table timed under load from 0.829 to 1.067 of the best fixed width.
- So one round, a probe slowed by a load burst say, never becomes a cost.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .table import NOISE_MS, STALE, CostTable

KEEP = 32          # recent rounds kept per (jobs, width)
MIN_SEEN = 5       # rounds before a width's own rounds replace the table's value


@dataclass(frozen=True)
class Cost:
    """`ms` per round of width `width` (block width + 1) from `rounds` rounds: "live" rounds of this process, else
    the table's timing ("scaled" when moved to the live AR step by `scale`), the newest `age_s` ago (None:
    unknown, e.g. a cached table from an older version)."""

    width: int
    ms: float
    rounds: int | None
    source: str
    age_s: float | None
    scale: float = 1.0


def scale_of(live: float, timed: float) -> float:
    """live / timed AR step where the live one runs STALE times cheaper (the table was timed under heavier load),
    else 1: a dearer live step is the moment's load, which the cache's check at the next start sees."""
    return 1.0 if live * STALE >= timed or timed - live < NOISE_MS else live / timed


class RoundCosts:
    """ms per round at the table's widths per job count: the table corrected by live rounds (module docstring)."""

    def __init__(self, table: CostTable, learn: bool = True, clock: Callable[[], float] = time.monotonic):
        self.table, self.learn, self.clock = table, learn, clock
        self.seen: dict[tuple[int, int], deque] = {}    # (jobs, width) -> its recent rounds' ms
        self.newest: dict[tuple[int, int], float] = {}  # (jobs, width) -> clock() at its newest round
        self.scale: dict[int, float] = {}               # timed concurrency -> live / timed AR (1: not scaled)
        self.made: dict[int, tuple[int, dict[int, float]]] = {}    # jobs -> (concurrencies timed, curve)

    def observe(self, jobs: int, width: int, ms: float) -> None:
        """A round of `jobs` jobs verifying `width` drafts took `ms`."""
        if self.learn and width in self.table.nearest(jobs) and math.isfinite(ms) and ms > 0:
            (got := self.seen.setdefault((jobs, width), deque(maxlen=KEEP))).append(ms)
            self.newest[(jobs, width)] = self.clock()
            if width == 0 and jobs in self.table.ms and len(got) >= MIN_SEEN and self.rescale(jobs, got):
                self.made.clear()                               # every table value near it moved
            elif len(got) >= MIN_SEEN and jobs in self.made:    # only this width's cost moved
                self.made[jobs][1][width] = statistics.median(got)

    def rescale(self, jobs: int, got: deque) -> bool:
        """Scale the table to the live AR step (scale_of), its cache told; whether the scale moved by 10 %."""
        live, timed = statistics.median(got), self.table.ms[jobs][0]
        scale, before = scale_of(live, timed), self.scale.get(jobs, 1.0)
        if abs(scale / before - 1) <= 0.1 and (scale == 1.0) == (before == 1.0):
            return False
        self.scale[jobs] = scale
        if scale != 1.0:
            self.table.disagrees(jobs, f"its AR step took {timed:.3g} ms, the live AR rounds {live:.3g} ms")
        return True

    def curve(self, jobs: int) -> dict[int, float]:
        """{w: ms} at the table's widths for `jobs` jobs (kept until a round, a scale or a newly timed concurrency
        changes it)."""
        timed, got = self.made.get(jobs, (0, None))
        if got is None or timed != len(self.table.ms):
            got = {c.width: c.ms for c in self.book(jobs)}
            self.made[jobs] = len(self.table.ms), got
        return got

    def book(self, jobs: int) -> list[Cost]:
        """Every cost in use at `jobs` jobs, with its rounds, source and age."""
        table, now = self.table, self.clock()
        age = None if table.timed_at is None else max(0.0, time.time() - table.timed_at)
        near = table.near_key(jobs)
        scale, counts = self.scale.get(near, 1.0), table.counts.get(near, {})
        out = []
        for w, t in table.nearest(jobs).items():
            got = self.seen.get((jobs, w), ())
            if len(got) >= MIN_SEEN:
                out.append(Cost(w, statistics.median(got), len(got), "live", now - self.newest[(jobs, w)]))
            else:
                out.append(Cost(w, t * scale, counts.get(w), "scaled" if scale != 1.0 else "table", age, scale))
        return out
