"""The drafting policy: each round's verify width, the one with the most expected tokens per ms.

A round that verifies w drafts emits E(w) = 1 + sum_{i<=w} a_i tokens on average and costs t(w, jobs); w = 0 is a
plain AR round with no drafter call. The policy picks argmax E(w) / t(w, jobs) among the widths the table timed,
from acceptance learnt in hindsight (acceptance.py) and a cost model corrected by observed rounds (costs.py).

While AR wins the drafter proposes nothing, so the policy probes with one full-width round after `gap` AR rounds;
the gap doubles after each probe that leaves AR ahead, up to the spacing at which probes cost `probe_budget` of AR
time, and resets once drafting wins. Both backends drive it the same way, round by round:

    policy.start(job, last_prompt_token)       a job begins
    w = policy.width(jobs)                     before a round of `jobs` jobs
    policy.observe([(job, proposal, Round)], ms)   after it: each job's full proposal and Round, the round's ms
    policy.finish(job)                         a job ends

A batching engine also asks `plain(jobs)` before a request: after a request at whose end no drafting width beat
an AR round of the speculative engine by `PLAIN_MARGIN`, the next 1, 4, then 16 requests of as many jobs decode
without the drafter (its K/V upkeep makes AR rounds on a speculative engine dearer than plain steps).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

from .acceptance import Acceptance, Hindsight
from .costs import CostTable, RoundCosts

PLAIN_MARGIN = 0.05     # drafting must beat AR rounds of the speculative engine by this much to keep the drafter
PLAIN_RUNS = (1, 4, 16)  # plain requests after the first, second, third such request in a row


class Policy:
    """Chooses each round's verify width and learns from the rounds it sees; one per backend, drafter and mode."""

    def __init__(self, block_size: int, costs: CostTable | None = None, fixed_width: int | None = None, *,
                 learn_costs: bool = False, prior: float = 0.6, decay: float = 0.95, probe_budget: float = 0.03,
                 min_probe_every: int = 4, first_probe_cost: float | None = None, carry_weight: float | None = None,
                 explore: float = 0.03):
        if fixed_width is None and (costs is None or block_size < 2):
            raise ValueError("an auto policy needs a cost table and a block size >= 2")
        if not 0 <= (fixed_width or 0) < max(block_size, 1):
            raise ValueError(f"width {fixed_width} outside 0..{block_size - 1}")
        self.block_size, self.fixed_width = block_size, fixed_width
        self.costs = RoundCosts(costs, block_size, learn_costs) if costs is not None else None
        self.acceptance = Acceptance(block_size - 1, prior, decay=decay)
        self.jobs: dict[Hashable, Hindsight] = {}
        self.probe_budget, self.min_probe_every, self.first_probe_cost = probe_budget, min_probe_every, first_probe_cost
        self.carry_weight, self.explore = carry_weight, explore
        self.gap = self.every = 0                   # AR rounds before the next probe, its doubling spacing (0: the floor)
        self.ar_rounds, self.answer_rounds, self.probing = 0, 0, False
        self.request = 0                            # decoding rounds of the request under way
        self.plain_left: dict[int, list[int]] = {}  # jobs -> [plain requests still to serve, requests in a row]
        self.plain_served = 0
        self.last_jobs = 1

    @classmethod
    def fixed(cls, width: int) -> Policy:
        """Verify `width` drafts every round (B-1 = the classic decoder, 0 = AR); drafts only those."""
        return cls(width + 1, fixed_width=width)

    @classmethod
    def auto(cls, block_size: int, costs: CostTable, **kw: Any) -> Policy:
        """Pick the width with the most expected tokens per ms every round; drafts all B-1 positions."""
        return cls(block_size, costs, **kw)

    @property
    def draft_len(self) -> int:
        """Ids to draft when drafting: all B-1 in auto mode (hindsight needs them), the width in fixed mode."""
        return self.block_size - 1 if self.fixed_width is None else self.fixed_width

    # -- the protocol ------------------------------------------------------------------------------------------

    def start(self, job: Hashable, last_token: int) -> None:
        """A job starts; its first proposal predicts the tokens after `last_token`."""
        self.jobs[job] = Hindsight(last_token)
        self.answer_rounds, self.probing = 0, False
        if self.carry_weight is not None:
            self.acceptance.forget(self.carry_weight)

    def finish(self, job: Hashable) -> None:
        self.jobs.pop(job, None)                   # its unresolved proposals are censored

    def width(self, jobs: int = 1) -> int:
        """The verify width of the next round of `jobs` jobs."""
        self.last_jobs = jobs
        if self.fixed_width is not None:
            return self.fixed_width
        w, self.probing = self.best(jobs), False
        if w > 0:
            self.gap = self.every = 0
        elif min(self.ar_rounds, self.answer_rounds) >= self.floor(jobs) and self.ar_rounds >= self.gap:
            self.probing, w = True, self.block_size - 1
        return w

    def observe(self, items: Sequence[tuple[Hashable, Sequence[int], Any]], ms: float | None = None) -> None:
        """Learn from one round: (job, its full proposal or (), its Round) for every job that emitted, and the
        round's ms (a cost observation when every job emitted a decoding round)."""
        drafted, accepted, prefill = False, 0, False
        for job, proposal, rnd in items:
            h = self.jobs.get(job)
            if h is not None:
                for length in h.add(proposal, rnd.tokens):
                    self.acceptance.update(length)
            drafted, accepted = drafted or bool(rnd.drafted), max(accepted, rnd.accepted)
            prefill = prefill or rnd.prefill
        if self.fixed_width is not None or prefill or not items:
            return
        width = max(len(r.drafted) for _, _, r in items)
        if ms and len(items) == self.last_jobs:
            self.costs.observe(self.last_jobs, width, ms)
        self.request += 1
        self.ar_rounds = 0 if drafted else self.ar_rounds + 1
        self.answer_rounds += 1
        if self.probing and self.best(self.last_jobs) == 0:
            self.back_off(accepted)
        self.probing = False

    # -- the choice --------------------------------------------------------------------------------------------

    def curve(self, jobs: int) -> list[float]:
        return self.costs.curve(jobs)

    def scores(self, jobs: int = 1) -> list[float]:
        """Expected tokens per ms for each width w = 0..B-1."""
        return [e / t for e, t in zip(self.acceptance.expected_tokens(), self.curve(jobs))]

    def best(self, jobs: int = 1) -> int:
        """Among the timed widths, the one with the most expected tokens per ms (ties: the narrower). While costs
        are learnt, a width not yet seen counts `explore` better than its estimate: a near-best width is tried
        for a few rounds, so the curve is measured where the decision is close."""
        s, seen = self.scores(jobs), self.costs.costs.get(jobs, {})
        bonus = 1 + self.explore if self.costs.learn else 1.0
        menu = [w for w in self.costs.table.widths(jobs) if w < self.block_size]
        return max(menu, key=lambda w: (s[w] * (1.0 if w in seen else bonus), -w))

    def probe_extra(self, jobs: int) -> float:
        """A full-width probe's cost beyond the AR rounds it replaces, in AR rounds (at least 1 % of one)."""
        t, e = self.curve(jobs), self.acceptance.expected_tokens()
        return max((t[-1] - t[0] * e[-1]) / t[0], 0.01)

    def floor(self, jobs: int) -> int:
        """AR rounds before any probe, in an answer and between probes: with `first_probe_cost`, until a probe
        costs at most that share of them, so a short answer never pays a whole probe."""
        if self.first_probe_cost is None:
            return self.min_probe_every
        return max(self.min_probe_every, min(math.ceil(self.probe_extra(jobs) / self.first_probe_cost), 1 << 16))

    def back_off(self, accepted: int) -> None:
        """After a probe that left AR ahead: probe again soon if this one alone beat AR, else wait twice as long,
        up to the spacing at which probes cost `probe_budget` of AR time."""
        jobs = self.last_jobs
        t, floor = self.curve(jobs), self.floor(jobs)
        cap = max(floor, min(math.ceil(self.probe_extra(jobs) / self.probe_budget), 1 << 16))
        if any((1 + w) / t[w] > 1 / t[0] for w in range(1, min(accepted, len(t) - 1) + 1)):
            self.gap = 0
        else:
            self.every = self.gap = min(2 * max(self.every, floor), cap)

    # -- whole requests on a batching engine ---------------------------------------------------------------------

    def plain(self, jobs: int) -> bool:
        """Whether a request of `jobs` jobs should decode without the drafter (module docstring); counts it."""
        state = self.plain_left.get(jobs)
        if self.fixed_width is not None or not state or state[0] <= 0:
            self.request = 0
            return False
        state[0] -= 1
        self.plain_served += 1
        return True

    def end_request(self, jobs: int) -> None:
        """A speculative request of `jobs` jobs ended: if drafting no longer pays, plan a run of plain requests."""
        rounds, self.request = self.request, 0
        if self.fixed_width is not None or not rounds or not self.acceptance.count:
            return
        state = self.plain_left.setdefault(jobs, [0, 0])
        s = self.scores(jobs)
        menu = [w for w in self.costs.table.widths(jobs) if 0 < w < self.block_size]
        if max(s[w] for w in menu) < (1 + PLAIN_MARGIN) * s[0]:
            state[0], state[1] = PLAIN_RUNS[min(state[1], len(PLAIN_RUNS) - 1)], state[1] + 1
        else:
            state[0] = state[1] = 0

    def report(self) -> dict:
        """The cost curves the policy started from and decides by (bench.json), and its plain requests."""
        out = self.costs.report() if self.costs is not None else {}
        if self.plain_served:
            out["plain_ar_requests"] = self.plain_served
        return out
