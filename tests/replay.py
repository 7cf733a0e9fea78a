"""A CPU replay of the pair bench, the drafting policy's regression test bed.

Inputs, committed under tests/data/replay/ (made by `python -m experiments.policy_replay`):
- lengths: the SmolLM2 pair's greedy answers to its held-out prompts and, at every answer position, the drafter's
  full-width accepted length L (greedy output does not depend on the widths verified, so one decode gives all);
- costs: round ms per (jobs, width) drawn from a device trace of the pair bench, the cost per emitted token beyond
  one per job, the prefill ms, and the calibration table the bench's `auto` cells started from.

A request's jobs decode together with one width per round, as exllamav3 does; a round costs a traced round of its
shape (an untraced width: its nearest traced width's, moved by the traced w=7 -> 15 slope), plus `switch_ms` when
its width differs from the last round's, plus host time (`auto` pays its own extra per round). Costs that carry
the device's noise in time (`noise`: each traced round's ms over its shape's median, in the bench's order) can
play it back instead: round k costs its shape's median times the k-th traced factor, so a slow stretch of the
device slows every width for a while, as it did there.
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
from collections import defaultdict
from pathlib import Path

from toolkit.benchmark.grid import job_list
from toolkit.exl3.calibrate import calibration_widths
from toolkit.policy.chooser import Policy
from toolkit.policy.costs import CostTable
from toolkit.runtime.events import Round

DATA = Path(__file__).parent / "data" / "replay"
MIN_ROUNDS = 5        # traced rounds a (jobs, width) needs to stand for itself
SWITCH_MS = 0.25      # a round at another width than the one before (median excess in the device traces)


def load(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())


class Costs:
    """Round ms per (jobs, width) drawn from traced rounds, plus a cost per emitted token beyond one per job."""

    def __init__(self, data: dict, seed: int = 0, timed_noise: bool = False):
        self.noise = data.get("noise") if timed_noise else None
        if timed_noise and not self.noise:
            raise ValueError("these costs carry no noise series")
        self.k = seed * 997                          # each seed starts the series at another round
        self.by = {tuple(map(int, k.split(","))): v for k, v in data["rounds"].items()}
        self.per_token, self.prefill = data["per_token_ms"], {int(c): v for c, v in data["prefill_ms"].items()}
        self.start = data["start"]
        self.rng = random.Random(seed)
        self.shapes: dict[tuple[int, int], list[float]] = {}
        self.medians: dict[tuple[int, int], float] = {}

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
                near = min((k for k in self.by if self.traced(*k)), key=lambda k: (abs(k[0] - jobs), abs(k[1] - w)))
                slope = (self.median(jobs, 15) - self.median(jobs, 7)) / 8 if self.traced(jobs, 15) and self.traced(jobs, 7) else 0.0
                shift = self.median(jobs, 0) - self.median(near[0], 0) if self.traced(jobs, 0) and self.traced(near[0], 0) else 0.0
                self.shapes[(jobs, w)] = [x + slope * (w - near[1]) + shift for x in self.by[near]]
        return self.shapes[(jobs, w)]

    def shape_median(self, jobs: int, w: int) -> float:
        if (jobs, w) not in self.medians:
            self.medians[(jobs, w)] = statistics.median(self.shape(jobs, w))
        return self.medians[(jobs, w)]

    def round_ms(self, jobs: int, w: int, extra_tokens: int) -> float:
        if self.noise:
            self.k += 1
            base = self.shape_median(jobs, w) * self.noise[self.k % len(self.noise)]
        else:
            base = self.rng.choice(self.shape(jobs, w))
        return base + self.per_token * extra_tokens

    def prefill_ms(self, c: int) -> float:
        return self.prefill[min(self.prefill, key=lambda k: (abs(k - c), k))] if self.prefill else 0.0


class Job:
    """One answer being decoded: its tokens, full-width lengths and how many it has emitted."""

    def __init__(self, row: dict, max_new: int):
        self.answer, self.lengths = row["answer"], row["lengths"]
        self.cap = min(max_new, len(self.answer))
        self.n = 1                                   # the prefill round emitted answer[0]

    def round(self, w: int, positions: int) -> tuple[tuple, Round]:
        """(full proposal or (), Round) of one round verifying w drafts."""
        start = self.n
        L = self.lengths[start - 1] if start - 1 < len(self.lengths) else 0
        e = min(min(L, w) + 1, self.cap - start)
        toks = self.answer[start:start + e]
        self.n += e
        if not w:
            return (), Round((), 0, toks[-1])
        proposal = tuple(self.answer[start:start + L]) + (-1,) * (positions - L)
        return proposal, Round(proposal[:w], e - 1, toks[-1], proposed=positions)


def replay_request(rows: list[dict], max_new: int, fixed: int | None, policy: Policy | None, costs: Costs,
                   positions: int, host_ms: float, switch_ms: float = SWITCH_MS, spec_ar: float = 1.0) -> tuple[int, float]:
    """(tokens, ms) of one request whose jobs decode together, one width per round; an AR round of a speculative
    request costs `spec_ar` times a plain one (the drafter's K/V upkeep)."""
    jobs = [Job(r, max_new) for r in rows]
    tokens, ms, last = len(jobs), costs.prefill_ms(len(jobs)), None
    plain = policy is not None and policy.plain(len(rows))
    if policy is not None and not plain:
        for i, r in enumerate(rows):
            policy.start(i, -2)
            policy.observe([(i, (), Round((), 0, r["answer"][0], prefill=True))])
    while live := [(i, j) for i, j in enumerate(jobs) if j.n < j.cap]:
        w = fixed if policy is None else 0 if plain else policy.width(len(live))
        out = [(i, *j.round(w, positions)) for i, j in live]
        emitted = sum(len(r.tokens) for _, _, r in out)
        t = costs.round_ms(len(live), w, emitted - len(live)) + (switch_ms if last not in (None, w) else 0.0)
        t *= spec_ar if policy is not None and not plain and not w else 1.0
        last, tokens, ms = w, tokens + emitted, ms + t + host_ms
        if policy is not None and not plain:
            policy.observe(out, t)
    if policy is not None and not plain:
        for i in range(len(rows)):
            policy.finish(i)
        policy.end_request(len(rows))
    return tokens, ms


def make_policy(costs: Costs, block_size: int, **kw) -> Policy:
    """The policy the exllamav3 backend builds, over the calibration table the bench's `auto` cells started from
    (the bench records its whole curve: only the widths calibration times are kept)."""
    widths = calibration_widths(block_size)
    table = {c: {w: t for w, t in pts.items() if int(w) in widths} for c, pts in costs.start.items()}
    return Policy.auto(block_size, CostTable(table), **{"learn_costs": True, **kw})


def replay(lengths: dict, cost_data: dict, concurrency: list[int], reps: int = 10, seed: int = 0,
           host_ms: float = 0.05, auto_host_ms: float = 0.05, spec_ar: float = 1.0, timed_noise: bool = False,
           **policy_kw) -> dict:
    """tok/ms of AR, auto, B=16 and B=8 at each concurrency, interleaved rep by rep as the bench runs them (one
    policy for every `auto` cell); per concurrency the medians, and auto over the best fixed width and over AR,
    paired per repetition."""
    B, max_new, rows = lengths["block_size"], lengths["max_new_tokens"], lengths["prompts"]
    costs = Costs(cost_data, seed, timed_noise)
    policy = make_policy(costs, B, **policy_kw)
    modes = ("ar", "auto", 16, 8)
    got: dict[tuple, list[float]] = defaultdict(list)
    for _ in range(reps):
        for c in concurrency:
            jobs = job_list(rows, c)
            waves = [jobs[k:k + c] for k in range(0, len(jobs), c)]
            for mode in modes:
                pol = policy if mode == "auto" else None
                w = None if pol else 0 if mode == "ar" else mode - 1
                warm = [dict(r, answer=r["answer"][:8]) for r in waves[0]]                # the untimed warm-up wave
                replay_request(warm, max_new, w, pol, costs, B - 1, host_ms, spec_ar=spec_ar)
                runs = [replay_request(req, max_new, w, pol, costs, B - 1, host_ms + (auto_host_ms if pol else 0),
                                       spec_ar=spec_ar) for req in waves]
                got[(c, mode)].append(sum(t for t, _ in runs) / sum(m for _, m in runs))
    out = {}
    for c in concurrency:
        row = {str(m): statistics.median(got[(c, m)]) for m in modes}
        best = max((16, 8), key=lambda m: row[str(m)])
        row["best"] = best
        row["auto_over_best"] = statistics.median(a / b for a, b in zip(got[(c, "auto")], got[(c, best)]))
        row["auto_over_ar"] = statistics.median(a / b for a, b in zip(got[(c, "auto")], got[(c, "ar")]))
        out[c] = row
    return out
