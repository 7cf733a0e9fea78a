"""The round costs the policy decides by: at the timed table's widths, a width seen at least MIN_SEEN times at a
job count costs the median of its last KEEP rounds there, any other the table's value. A table timed under other
load, on another machine or by another version is corrected after a few rounds of each width."""

from __future__ import annotations

import math
import statistics
from collections import deque

from ..costs.table import CostTable

KEEP = 32          # recent rounds kept per (jobs, width)
MIN_SEEN = 5       # rounds before a width's own rounds replace the table's value


class RoundCosts:
    """ms per round at the table's widths per job count: the table corrected by observed rounds (module docstring)."""

    def __init__(self, table: CostTable, learn: bool = True):
        self.table, self.learn = table, learn
        self.seen: dict[tuple[int, int], deque] = {}    # (jobs, width) -> its recent rounds' ms
        self.made: dict[int, tuple[int, dict[int, float]]] = {}    # jobs -> (concurrencies timed, curve)

    def observe(self, jobs: int, width: int, ms: float) -> None:
        """A round of `jobs` jobs verifying `width` drafts took `ms`."""
        if self.learn and width in self.table.nearest(jobs) and math.isfinite(ms) and ms > 0:
            (got := self.seen.setdefault((jobs, width), deque(maxlen=KEEP))).append(ms)
            if len(got) >= MIN_SEEN and jobs in self.made:      # only this width's cost moved
                self.made[jobs][1][width] = statistics.median(got)

    def curve(self, jobs: int) -> dict[int, float]:
        """{w: ms} at the table's widths for `jobs` jobs (kept until a round of `jobs` jobs or a newly timed
        concurrency changes it)."""
        timed, got = self.made.get(jobs, (0, None))
        if got is None or timed != len(self.table.ms):
            seen = self.seen.get
            got = {w: statistics.median(seen((jobs, w))) if len(seen((jobs, w), ())) >= MIN_SEEN else t
                   for w, t in self.table.nearest(jobs).items()}
            self.made[jobs] = len(self.table.ms), got
        return got
