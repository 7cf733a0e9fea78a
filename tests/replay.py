"""A CPU replay of the pair bench, the drafting policy's regression test bed.

Inputs, committed under tests/data/replay/ (made by `python -m experiments.policy_replay`):
- lengths: the SmolLM2 pair's greedy answers to its held-out prompts and, at every answer position, the drafter's
  full-width accepted length L and each proposed position's score (its winning logit; greedy output does not
  depend on the widths verified, so one decode gives all);
- costs: round ms per (jobs, width) drawn from a device trace of the pair bench, the cost per emitted token beyond
  one per job, the prefill ms, and the calibration table the bench's `auto` cells started from.

A request's jobs decode together with one width per round, as exllamav3 does; a round costs a traced round of its
shape (an untraced width: its nearest traced width's, drafting or not as it is, moved by the traced w=7 -> 15
slope), plus `switch_ms` when
its width differs from the last round's, plus host time (a policy pays its own extra per round). Costs that carry
the device's noise in time (`noise`: each traced round's ms over its shape's steady median, in the bench's order)
can play it back instead: round k costs its shape's steady median (the slow stretches taken out) times the k-th
traced factor, so a slow stretch of the device slows every width for a while, as it did there.

Modes are compared on common draws: each repetition at each concurrency is a slot, and every mode of a slot
replays the same cost draws and the same stretch of the noise series from its first round, so a slow stretch
meets each mode at the same point of its run (the series then moves on by the longest mode's rounds).
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.benchmark.grid import job_list
from toolkit.exl3.calibrate import calibration_widths
from toolkit.policy.chooser import Policy
from toolkit.costs.table import CostTable
from toolkit.runtime.events import Round

DATA = Path(__file__).parent / "data" / "replay"
MIN_ROUNDS = 5        # traced rounds a (jobs, width) needs to stand for itself
SWITCH_MS = 0.25      # a round at another width than the one before (median excess in the device traces)


def load(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


@dataclass(frozen=True)
class Load:
    """A busy machine: the table timed under load (each width's factor; -1: every other drafting width's), and a load
    burst over rounds burst_from+1..burst_to of each slot (x `burst`, whatever the mode runs then)."""

    table: dict = field(default_factory=dict)
    burst_from: int = 0
    burst_to: int = 0
    burst: float = 1.0

    def factor(self, w: int) -> float:
        return self.table.get(w, self.table.get(-1, 1.0) if w else 1.0)


class Costs:
    """Round ms per (jobs, width) drawn from traced rounds, plus a cost per emitted token beyond one per job."""

    def __init__(self, data: dict, seed: int = 0, timed_noise: bool = False, load: Load | None = None):
        self.load = load or Load()
        self.noise = data.get("noise") if timed_noise else None
        if timed_noise and not self.noise:
            raise ValueError("these costs carry no noise series")
        self.seed = seed
        self.by = {tuple(map(int, k.split(","))): v for k, v in data["rounds"].items()}
        if self.noise and "steady" in data:           # the noise is relative to the steady medians: played once
            steady = {tuple(map(int, k.split(","))): v for k, v in data["steady"].items()}
            self.by = {k: [x * steady[k] / statistics.median(v) for x in v] for k, v in self.by.items()}
        self.per_token, self.prefill = data["per_token_ms"], {int(c): v for c, v in data["prefill_ms"].items()}
        self.start = data["start"]
        self.shapes: dict[tuple[int, int], list[float]] = {}
        self.medians: dict[tuple[int, int], float] = {}
        self.origin = seed * 997                      # each seed starts the noise series at another round
        self.begin()

    def begin(self, slot: int = 0) -> None:
        """Rewind the draws to the start of `slot`: every mode of a slot meets the same costs."""
        self.rng, self.k = random.Random(self.seed * 1_000_003 + slot), self.origin

    def advance(self, rounds: int) -> None:
        """The next slot plays the noise series from `rounds` rounds further on."""
        self.origin += rounds

    def traced(self, jobs: int, w: int) -> bool:
        return len(self.by.get((jobs, w), ())) >= MIN_ROUNDS

    def median(self, jobs: int, w: int) -> float:
        return statistics.median(self.by[(jobs, w)])

    def shape(self, jobs: int, w: int) -> list[float]:
        """The traced rounds of (jobs, w), or the nearest traced shape's moved to it (job count first)."""
        if (jobs, w) not in self.shapes:
            if self.traced(jobs, w):
                self.shapes[(jobs, w)] = self.by[(jobs, w)]
            else:
                near = min((k for k in self.by if self.traced(*k) and (k[1] > 0) == (w > 0)),
                           key=lambda k: (abs(k[0] - jobs), abs(k[1] - w)))
                slope = (self.median(jobs, 15) - self.median(jobs, 7)) / 8 if self.traced(jobs, 15) and self.traced(jobs, 7) else 0.0
                shift = self.median(jobs, 0) - self.median(near[0], 0) if self.traced(jobs, 0) and self.traced(near[0], 0) else 0.0
                self.shapes[(jobs, w)] = [x + slope * (w - near[1]) + shift for x in self.by[near]]
        return self.shapes[(jobs, w)]

    def shape_median(self, jobs: int, w: int) -> float:
        if (jobs, w) not in self.medians:
            self.medians[(jobs, w)] = statistics.median(self.shape(jobs, w))
        return self.medians[(jobs, w)]

    def round_ms(self, jobs: int, w: int, extra_tokens: int) -> float:
        self.k += 1
        if self.noise:
            base = self.shape_median(jobs, w) * self.noise[self.k % len(self.noise)]
        else:
            base = self.rng.choice(self.shape(jobs, w))
        if self.load.burst_from < self.k - self.origin <= self.load.burst_to:     # a load burst in the slot
            base *= self.load.burst
        return base + self.per_token * extra_tokens

    def prefill_ms(self, c: int) -> float:
        return self.prefill[min(self.prefill, key=lambda k: (abs(k - c), k))] if self.prefill else 0.0


class Job:
    """One answer being decoded: its tokens, full-width lengths, proposal scores and how many it has emitted."""

    def __init__(self, row: dict, max_new: int):
        self.answer, self.lengths, self.scores = row["answer"], row["lengths"], row.get("conf")
        self.cap = min(max_new, len(self.answer))
        self.n = 1                                   # the prefill round emitted answer[0]

    def conf(self) -> list[float]:
        """The scores of the proposal the next round drafts."""
        return self.scores[self.n - 1]

    def advance(self, w: int) -> int:
        """Emit one round verifying w drafts; how many tokens it emitted."""
        L = self.lengths[self.n - 1] if self.n - 1 < len(self.lengths) else 0
        e = min(min(L, w) + 1, self.cap - self.n)
        self.n += e
        return e

    def round(self, w: int, positions: int, propose: bool = False) -> tuple[tuple, Round]:
        """(full proposal, or () when nothing was drafted, and the Round) of one round verifying w drafts."""
        start = self.n
        L = self.lengths[start - 1] if start - 1 < len(self.lengths) else 0
        e = self.advance(w)
        if not (w or propose):
            return (), Round((), 0, self.answer[start], proposed=0)
        proposal = tuple(self.answer[start:start + L]) + (-1,) * (positions - L)
        return proposal, Round(proposal[:w], e - 1, self.answer[start + e - 1], proposed=len(proposal) if w else 0)


def replay_request(rows: list[dict], max_new: int, mode, costs: Costs, positions: int, host_ms: float,
                   switch_ms: float = SWITCH_MS, spec_ar: float = 1.0) -> tuple[int, float, int]:
    """(tokens, ms, rounds) of one request whose jobs decode together, one width per round. `mode` is a fixed
    width or a policy (the backends' protocol; one with `window(jobs)` picks from the live jobs' proposals, which
    it always drafts, so its empty windows cost a w=1 round). An AR round of a speculative request costs `spec_ar` times a plain one (the drafter's K/V)."""
    jobs = [Job(r, max_new) for r in rows]
    tokens, ms, last, n = len(jobs), costs.prefill_ms(len(jobs)), None, 0
    policy = None if isinstance(mode, int) else mode
    window = getattr(policy, "window", None)
    plain = policy is not None and policy.plain(len(rows))
    if policy is not None and not plain:
        for i in range(len(rows)):
            policy.start(i, -2)
        policy.observe([(i, (), Round((), 0, r["answer"][0], prefill=True)) for i, r in enumerate(rows)])   # one iterate
    while live := [(i, j) for i, j in enumerate(jobs) if j.n < j.cap]:
        if policy is None:
            w, out = mode, []
            emitted = 0
            for _, j in live:
                emitted += j.advance(w)
        else:
            w = 0 if plain else window([j for _, j in live]) if window else policy.width(len(live))
            out = [(i, *j.round(w, positions, window is not None)) for i, j in live]
            emitted = sum(r.accepted + 1 for _, _, r in out)
        shape = max(w, 1) if window else w                 # an empty window still ran the drafter
        t = costs.round_ms(len(live), shape, emitted - len(live)) + (switch_ms if last not in (None, w) else 0.0)
        t *= spec_ar if policy is not None and not plain and not w else 1.0
        last, tokens, ms, n = w, tokens + emitted, ms + t + host_ms, n + 1
        if policy is not None and not plain:
            policy.observe(out, t)
    if policy is not None and not plain:
        for i in range(len(rows)):
            policy.finish(i)
        policy.end_request(len(rows))
    return tokens, ms, n


def start_table(costs: Costs, block_size: int) -> CostTable:
    """The calibration table the bench's `auto` cells started from (the bench records its whole curve: only the
    widths calibration times are kept), as timed under the scenario's load (Load.table)."""
    widths = calibration_widths(block_size)
    return CostTable({c: {w: t * costs.load.factor(int(w)) for w, t in pts.items() if int(w) in widths}
                      for c, pts in costs.start.items()},
                     counts={c: {int(w): 5 for w in pts} for c, pts in costs.start.items()})


def make_policy(costs: Costs, block_size: int, **kw) -> Policy:
    """The policy the exllamav3 backend builds, over the calibration table."""
    return Policy.auto(block_size, start_table(costs, block_size), **{"learn_costs": True, **kw})


Factory = Callable[[Costs, int], object]      # (costs, block size) -> a policy, made once per replay


def run_modes(lengths: dict, cost_data: dict, concurrency: list[int], modes: dict[str, int | Factory],
              reps: int = 10, seed: int = 0, host_ms: float = 0.05, policy_host_ms: float = 0.05,
              spec_ar: float = 1.0, timed_noise: bool = False, fresh: bool = False,
              load: Load | None = None) -> dict[int, dict[str, list[float]]]:
    """tok/ms of every mode (a fixed width or a policy factory) per concurrency and repetition, interleaved rep by
    rep as the bench runs them (one policy per mode for every cell; with `fresh` a new one per request, as every
    `generate` run and app turn starts), each slot on common draws."""
    B, max_new, rows = lengths["block_size"], lengths["max_new_tokens"], lengths["prompts"]
    costs = Costs(cost_data, seed, timed_noise, load)
    made = {m: f if isinstance(f, int) else f(costs, B) for m, f in modes.items()}
    got: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    slot = 0
    for _ in range(reps):
        for c in concurrency:
            jobs = job_list(rows, c)
            waves = [jobs[k:k + c] for k in range(0, len(jobs), c)]
            longest = 0
            for m, mode in made.items():
                costs.begin(slot)
                host = host_ms + (0.0 if isinstance(mode, int) else policy_host_ms)
                warm = [dict(r, answer=r["answer"][:8]) for r in waves[0]]                # the untimed warm-up wave
                again = fresh and not isinstance(mode, int)
                runs = [replay_request(req, max_new, modes[m](costs, B) if again else mode, costs, B - 1, host,
                                       spec_ar=spec_ar) for req in [warm] + waves]
                got[c][m].append(sum(t for t, _, _ in runs[1:]) / sum(ms for _, ms, _ in runs[1:]))
                longest = max(longest, sum(n for _, _, n in runs))
            costs.advance(longest)
            slot += 1
    return got


def ratios(got: dict[int, dict[str, list[float]]], fixed: list[str]) -> dict[int, dict]:
    """Per concurrency: the best of the `fixed` modes (by median tok/ms) and each mode over it and over AR,
    paired per repetition (median)."""
    out = {}
    for c, by in got.items():
        best = max(fixed, key=lambda m: statistics.median(by[m]))
        row: dict = {"best": best}
        for m, xs in by.items():
            row[m] = {"over_best": statistics.median(a / b for a, b in zip(xs, by[best])),
                      "over_ar": statistics.median(a / b for a, b in zip(xs, by["ar"]))}
        out[c] = row
    return out
