"""The drafting policy: each round's verify width, the one with the most expected tokens per ms.

- A round of `jobs` jobs verifying w drafts emits E(w) = 1 + a_1 + ... + a_w tokens per job and costs t(w) ms
  (costs/book.py); w = 0 is an AR round. The policy verifies argmax E(w) / t(w) over the widths its cost table timed.
- a_i = P(L >= i), L a proposal's full-width accepted length: the drafter proposes all B-1 ids whatever w is, and
  the target's later tokens show L. A request starts from the long-run rates (every proposal so far; 0 before
  any), weighing CARRY proposals. Each resolved proposal then weighs 1 and fades the older ones by
  DECAY ** jobs (a batch follows its present jobs).
- While AR wins nothing is proposed, so one round probes at full width: at once while no proposal was ever resolved
  and full acceptance would pay (a fresh policy knows nothing), then after `gap` AR rounds: MIN_GAP after a
  width that won, doubling after each probe, at most (and from a job's start, so a short answer never pays a
  whole probe) the spacing at which a probe's cost beyond the AR rounds it replaces is PROBE_BUDGET of them, from
  the costs in use: a probe slowed by a load burst neither is a cost nor pushes the next probe away.
- A batching engine asks `plain(jobs)` before a request: after a request at whose end no width beats AR by
  PLAIN_MARGIN at the long-run rates, the next 1, 4, then 16 requests of as many jobs decode without the drafter
  (its K/V upkeep makes AR rounds of a speculative engine dearer than plain steps).

Both backends drive it the same way, round by round:

    policy.start(job, last_prompt_token)           a job begins
    w = policy.width(jobs)                         before a round of `jobs` jobs
    policy.observe([(job, proposal, Round)], ms)   after it: each job's full proposal and Round, the round's ms
    policy.finish(job)                             a job ends
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from itertools import accumulate
from typing import Any

from ..costs.book import RoundCosts
from ..costs.table import CostTable

CARRY = 2.0              # proposals a request's starting rates weigh
DECAY = 0.93             # older proposals fade by DECAY ** jobs per resolved one
PROBE_BUDGET = 0.03      # while AR wins, probes cost this share of the AR time
MIN_GAP = 2              # AR rounds before the first probe after a width that won
PLAIN_MARGIN = 0.1       # drafting must beat AR rounds of the speculative engine by this much to keep the drafter
PLAIN_RUNS = (1, 4, 16)  # plain requests after the first, second, third such request in a row


class Policy:
    """Chooses each round's verify width and learns from the rounds it sees; one per backend, drafter and mode."""

    def __init__(self, block_size: int, costs: CostTable | None = None, fixed_width: int | None = None, *,
                 learn_costs: bool = False):
        if fixed_width is None and (costs is None or block_size < 2):
            raise ValueError("an auto policy needs a cost table and a block size >= 2")
        if not 0 <= (fixed_width or 0) < max(block_size, 1):
            raise ValueError(f"width {fixed_width} outside 0..{block_size - 1}")
        self.block_size, self.fixed_width = block_size, fixed_width
        self.costs = RoundCosts(costs, learn_costs) if costs is not None else None
        self.total = [0.0] * (block_size - 1), 1.0   # long-run sums of [L >= i] and their weight (0 at first)
        self.sums, self.weight, self.count = list(self.total[0]), 1.0, 0
        self.jobs: dict[Hashable, list] = {}        # job -> [emitted tokens, pending [start, proposal, matched]]
        self.ar_rounds = self.request = 0           # AR rounds since drafting or a job's start; rounds of the request
        self.every, self.probing = 1 << 16, False   # the present spacing of probes, whether this round probes
        self.last_jobs, self.plain_served = 1, 0
        self.plain_left: dict[int, list[int]] = {}  # jobs -> [plain requests to serve, losing requests in a row]

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
        if not self.jobs:                           # a new request
            sums, weight = self.total
            self.sums, self.weight = [s * CARRY / weight for s in sums], CARRY
        self.jobs[job] = [[last_token], []]
        self.ar_rounds, self.every = 0, 1 << 16

    def finish(self, job: Hashable) -> None:
        self.jobs.pop(job, None)                    # its unresolved proposals are censored

    def width(self, jobs: int = 1) -> int:
        """The verify width of the next round of `jobs` jobs."""
        self.last_jobs = jobs
        if self.fixed_width is not None:
            return self.fixed_width
        w = self.best(jobs)
        fresh = not self.count and self.could_pay(jobs)          # no proposal seen yet: learn from one now
        self.probing = w == 0 and (fresh or self.ar_rounds >= min(self.every, self.gap(jobs)))
        return max(self.scores(jobs)) if self.probing else w

    def observe(self, items: Sequence[tuple[Hashable, Sequence[int], Any]], ms: float | None = None) -> None:
        """Learn from one round: (job, its full proposal or (), its Round) for every job that emitted, and the
        round's ms (a cost observation when every job emitted a decoding round)."""
        fade, width, prefill = self.fade(len(items)), 0, False
        for job, proposal, rnd in items:
            for length in self.resolve(job, proposal, rnd.tokens):
                self.learn(length, fade)
            width, prefill = max(width, len(rnd.drafted)), prefill or rnd.prefill
        if self.fixed_width is not None or not items or prefill:
            return
        if ms and len(items) == self.last_jobs:
            self.costs.observe(self.last_jobs, width, ms)
        self.request += 1
        self.ar_rounds = 0 if width else self.ar_rounds + 1
        if width:                                   # probes back off; a width that won brings the next one close
            self.every = min(2 * self.every, 1 << 16) if self.probing else MIN_GAP

    # -- acceptance, in hindsight ------------------------------------------------------------------------------

    def resolve(self, job: Hashable, proposal: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Record a round of `job` (its full proposal, its emitted tokens); return the lengths L it resolved."""
        state = self.jobs.get(job)
        if state is None:
            return []
        stream, pending = state
        if proposal:
            pending.append([len(stream), tuple(proposal), 0])
        stream.extend(tokens)
        done, state[1] = [], []
        for p in pending:
            start, ids, j = p
            while j < len(ids) and start + j < len(stream) and ids[j] == stream[start + j]:
                j += 1
            if j == len(ids) or start + j < len(stream):      # all confirmed, or a mismatch seen
                done.append(j)
            else:
                p[2] = j
                state[1].append(p)
        return done

    def fade(self, jobs: int) -> float:
        """How much older proposals fade per proposal resolved in a round of `jobs` jobs."""
        return DECAY ** jobs

    def learn(self, length: int, fade: float) -> None:
        """One proposal's full-width accepted length, into the request's and the long-run rates."""
        self.sums, (total, n) = [fade * s for s in self.sums], self.total
        for i in range(min(length, len(total))):
            self.sums[i] += 1.0
            total[i] += 1.0
        self.weight, self.total, self.count = fade * self.weight + 1.0, (total, n + 1.0), self.count + 1

    @property
    def rates(self) -> list[float]:
        """a_i = P(L >= i), i = 1..B-1, as the request's rounds estimate it."""
        return [s / self.weight for s in self.sums]

    def expected_tokens(self, rates: Sequence[float] | None = None) -> list[float]:
        """E(w) = 1 + sum_{i<=w} a_i for w = 0..B-1 (at the request's rates unless given)."""
        return list(accumulate(self.rates if rates is None else rates, initial=1.0))

    # -- the choice --------------------------------------------------------------------------------------------

    def scores(self, jobs: int = 1, rates: Sequence[float] | None = None) -> dict[int, float]:
        """Expected tokens per ms of each timed width."""
        e = self.expected_tokens(rates)
        return {w: e[w] / t for w, t in self.costs.curve(jobs).items() if w < self.block_size}

    def best(self, jobs: int = 1) -> int:
        """The timed width with the most expected tokens per ms (ties: the narrower)."""
        s = self.scores(jobs)
        return max(s, key=lambda w: (s[w], -w))

    def could_pay(self, jobs: int) -> bool:
        """Whether some width would beat AR if every draft were accepted."""
        s = self.scores(jobs, [1.0] * (self.block_size - 1))
        return max(s) > 0 and s[max(s, key=s.get)] > s[0]

    def gap(self, jobs: int) -> int:
        """The widest spacing of probes: a probe's cost beyond the AR rounds it replaces, over PROBE_BUDGET of one."""
        t, e = self.costs.curve(jobs), self.expected_tokens()
        w = max(w for w in t if w < self.block_size)
        return max(MIN_GAP, min(math.ceil(max(t[w] / t[0] - e[w], 0.01) / PROBE_BUDGET), 1 << 16))

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
        if self.fixed_width is not None or not rounds or not self.count:
            return
        state = self.plain_left.setdefault(jobs, [0, 0])
        s = self.scores(jobs, [x / self.total[1] for x in self.total[0]])
        if max(x for w, x in s.items() if w) < (1 + PLAIN_MARGIN) * s[0]:
            state[0], state[1] = PLAIN_RUNS[min(state[1], len(PLAIN_RUNS) - 1)], state[1] + 1
        else:
            state[0] = state[1] = 0
