"""Round costs learnt online per verify width and concurrency, from the rounds a drafting policy observes.

The policy starts from a timed table (exllamav3: dummy prompts at a 256-token context, exl3_calibrate.calibrate),
which can rise with the width much more than real decoding rounds do. `LearnedCosts` keeps, per concurrency c and
width w, the last `keep` observed round times, except *warm-up* rounds: the first `warmup` observed rounds after
the (c, w) of the observed rounds changed (another width, or another job count), which covers the first rounds
ever of a (c, w) (exllamav3 runs a new shape eagerly, then captures its CUDA graph; later rounds replay it). A
width is *settled* once it has `min_seen` kept rounds and was kept within the last `stale_after` rounds at c, and
its cost is then the `quantile` (the 25th percentile) of its kept rounds: host jitter only adds to a round, so the
low end is the round's own cost, and one slow round moves nothing. The learned curve at c, over the table's curve
at c (the prior):

- w = 0 (AR) on its own: its cost once settled, else the table;
- the settled drafting widths' costs, made non-decreasing in w by pooling adjacent violators into their mean
  weighted by kept rounds (isotonic regression, so one noisy width does not raise all wider ones): a settled
  width costs its pooled value; between two settled widths, the table's shape scaled to pass through both;
  beyond the outermost settled width, the table times that width's observed/tabled ratio, so a flat observed
  curve flattens the whole drafting curve and a width never picked follows its observed neighbours;
- then made non-decreasing in w, as CostTable.curve does. With no settled drafting width it is the table.

A settled width that is not seen again goes stale and follows its neighbours, so it cannot stay wrongly
expensive forever. `cost_report` renders a policy's starting and learned curves for bench.json.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .policy import monotone

if TYPE_CHECKING:
    from .policy import Policy

MIN_SEEN = 3          # kept rounds before a width's own cost replaces the table's
KEEP = 16             # kept rounds per width the quantile is taken over
QUANTILE = 0.25       # a width's cost: this quantile of its kept rounds (jitter is additive: the floor is the cost)
WARMUP = 2            # rounds not learnt from after the (concurrency, width) of the rounds changed
STALE_AFTER = 512     # rounds at that concurrency after which an unseen width's observations no longer count


@dataclass
class WidthTimes:
    """The recent round times of one width at one concurrency."""

    times: deque = field(default_factory=lambda: deque(maxlen=KEEP))
    n: int = 0                 # rounds kept in all
    skipped: int = 0           # warm-up rounds, not learnt from
    last: int = 0              # the concurrency's round count at the last kept round
    cost: float = 0.0          # the low quantile of `times`


class LearnedCosts:
    """Observed ms per round, per concurrency and verify width; `curve` turns them and a prior into t_round(w)."""

    def __init__(self, min_seen: int = MIN_SEEN, keep: int = KEEP, stale_after: int = STALE_AFTER,
                 warmup: int = WARMUP, quantile: float = QUANTILE):
        self.min_seen, self.keep, self.stale_after = min_seen, keep, stale_after
        self.warmup, self.quantile = warmup, quantile
        self.widths: dict[int, dict[int, WidthTimes]] = {}
        self.rounds: dict[int, int] = {}
        self.shape: tuple[int, int] | None = None        # (concurrency, width) of the last timed round
        self.streak = 0                                  # timed rounds in a row at that shape
        self._curves: dict[int, tuple] = {}              # concurrency -> ((settled costs and weights, prior), their curve)

    def observe(self, concurrency: int, width: int, ms: float) -> None:
        """One round of `concurrency` jobs at verify width `width` took `ms` (kept unless a warm-up round)."""
        if not (ms > 0 and math.isfinite(ms)):
            return
        shape = (concurrency, width)
        self.streak, self.shape = (self.streak + 1 if shape == self.shape else 1), shape
        k = self.rounds[concurrency] = self.rounds.get(concurrency, 0) + 1
        s = self.widths.setdefault(concurrency, {}).setdefault(width, WidthTimes(deque(maxlen=self.keep)))
        if self.streak <= self.warmup:
            s.skipped += 1
            return
        s.times.append(float(ms))
        s.n, s.last, s.cost = s.n + 1, k, low_quantile(s.times, self.quantile)

    def settled(self, concurrency: int) -> dict[int, float]:
        """{w: ms} of the widths with at least `min_seen` kept rounds, seen within `stale_after` rounds."""
        k = self.rounds.get(concurrency, 0)
        return {w: s.cost for w, s in sorted(self.widths.get(concurrency, {}).items())
                if s.n >= self.min_seen and k - s.last < self.stale_after}

    def curve(self, concurrency: int, prior: Sequence[float]) -> list[float]:
        """t_round(w) for w = 0..len(prior)-1: the prior corrected by the settled widths (module docstring)."""
        got = self.settled(concurrency)
        ws = self.widths.get(concurrency, {})
        points = tuple((w, t, len(ws[w].times)) for w, t in got.items())     # (width, cost, kept rounds)
        key = (points, tuple(prior))
        hit = self._curves.get(concurrency)
        if hit is not None and hit[0] == key:            # many rounds change no settled cost; the policy asks every round
            return list(hit[1])
        spec = monotone([p for p in points if 0 < p[0] < len(prior)])
        out, j = [got.get(0, prior[0])], 0
        for w in range(1, len(prior)):
            while j < len(spec) and spec[j][0] < w:
                j += 1                                   # spec[j]: the first settled width >= w
            lo, hi = spec[j - 1] if j else None, spec[j] if j < len(spec) else None
            out.append(max(out[-1], estimate(w, lo, hi, prior)))
        self._curves[concurrency] = (key, tuple(out))
        return out

    def observed(self, concurrency: int) -> dict[int, dict]:
        """{w: {"ms": its cost (None: none kept), "rounds": rounds kept, "warmup": rounds skipped}} at
        `concurrency` (bench.json)."""
        seen = sorted(self.widths.get(concurrency, {}).items())
        return {w: {"ms": round(s.cost, 3) if s.n else None, "rounds": s.n, "warmup": s.skipped} for w, s in seen}


def low_quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of xs, linear between the order statistics (q = 0.5: the median)."""
    v = sorted(xs)
    pos = q * (len(v) - 1)
    i = int(pos)
    return v[i] if i + 1 >= len(v) else v[i] + (v[i + 1] - v[i]) * (pos - i)


def estimate(w: int, lo: tuple[int, float] | None, hi: tuple[int, float] | None, prior: Sequence[float]) -> float:
    """ms of drafting width w from the settled (width, ms) points around it (lo < w <= hi) and the prior curve."""
    if hi is not None and hi[0] == w:
        return hi[1]
    if lo is None and hi is None:
        return prior[w]
    if lo is None or hi is None:                         # outside the settled range: the nearest one's ratio
        v, t = lo or hi
        return prior[w] * t / prior[v]
    (a, ta), (b, tb) = lo, hi
    span = prior[b] - prior[a]
    f = (prior[w] - prior[a]) / span if span > 0 else (w - a) / (b - a)
    return ta + (tb - ta) * f


def as_ms(curve: Sequence[float]) -> dict[int, float]:
    """A curve as {w: ms}, rounded to the microsecond."""
    return {w: round(float(t), 3) for w, t in enumerate(curve)}


def cost_report(policy: Policy) -> dict:
    """{"start": {c: {w: ms}}, "learned": {c: {w: ms}}, ...} of an auto policy: the curve it started from (its
    table) and the one it decides by now. A BatchPolicy reports every concurrency it knows (and what it observed);
    a torch Policy has one sequence (c = 1) and a single drafting cost factor (`drift`)."""
    own: Callable[[], dict] | None = getattr(policy, "cost_report", None)
    if callable(own):
        return own()
    return {"start": {1: as_ms(policy.table)}, "learned": {1: as_ms(policy.t)}, "drift": policy.drift}
