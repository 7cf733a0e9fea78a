"""The replay's rivals to the drafting policy (tests/replay.py).

`Exl3Window` is exllamav3 1.6.5's own dynamic draft window (Generator(dynamic_draft_tokens=True), its
DraftConfidenceCalibrator), written again from its source for the replay: the drafter scores every proposed
position by its winning logit; scores fall into bins of width 1 holding decayed (tested, accepted) counts; the
threshold is the lower edge of the lowest bin from which every populated bin (8+ labels) up accepts at least
`confidence`; each round verifies up to the first position scoring below it, the longest such cut over the jobs.
Labels come from the positions the target tested: the accepted ones, and the first one after them (accepted only
when the window cut it and the target's next token equals it). Before 64 labels, and while no bin is populated,
windows are full. The counts decay by 0.995 per round.

The scores are the CPU drafter's (the BF16 drafter in fp32 over the committed answers), the score exllamav3 takes
(the target head's winning logit over the drafter's state), not the device's EXL3 drafter's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tests import replay as R
from toolkit.policy.chooser import DECAY, Policy
from toolkit.costs.book import RoundCosts


class Exl3Window:
    """exllamav3 1.6.5's confidence-calibrated window (module docstring), behind the policies' protocol."""

    def __init__(self, positions: int, confidence: float = 0.4, decay: float = 0.995, min_count: float = 8.0,
                 burn_in: float = 64.0):
        self.positions, self.confidence, self.decay = positions, confidence, decay
        self.min_count, self.burn_in = min_count, burn_in
        self.bins: dict[int, list[float]] = {}      # floor(score) -> [tested, accepted], decayed
        self.total = 0.0
        self.round: list[list[float]] = []          # the live jobs' scores this round, in order

    def threshold(self) -> float:
        if self.total < self.burn_in:
            return -math.inf
        thr, populated = math.inf, False
        for idx in sorted(self.bins, reverse=True):
            tested, accepted = self.bins[idx]
            if tested < self.min_count:
                continue
            populated = True
            if accepted / tested < self.confidence:
                break
            thr = float(idx)
        return thr if populated else -math.inf

    def window(self, jobs: Sequence) -> int:
        """The round's verify width: up to each job's first score below the threshold, the longest over jobs."""
        thr = self.threshold()
        self.round = [job.conf() for job in jobs]
        return max(next((p for p, x in enumerate(conf) if x < thr), self.positions) for conf in self.round)

    def label(self, score: float, accepted: bool) -> None:
        b = self.bins.setdefault(math.floor(score), [0.0, 0.0])
        b[0] += 1.0
        b[1] += float(accepted)
        self.total += 1.0

    def observe(self, items, ms: float | None = None) -> None:
        if not self.round:
            return                                   # the prefill round
        for (_, proposal, rnd), conf in zip(items, self.round):
            a = rnd.accepted
            for p in range(a):
                self.label(conf[p], True)
            if a < len(conf) and a < len(proposal):
                self.label(conf[a], proposal[a] == rnd.bonus)
        for b in self.bins.values():
            b[0] *= self.decay
            b[1] *= self.decay
        self.total *= self.decay
        self.round = []

    def start(self, job, last_token: int) -> None:
        pass

    def finish(self, job) -> None:
        pass

    def plain(self, jobs: int) -> bool:
        return False

    def end_request(self, jobs: int) -> None:
        pass


def exl3_window(costs: R.Costs, block_size: int) -> Exl3Window:
    return Exl3Window(block_size - 1)




# -- the ablation: each mechanism of the policy switched off in turn ---------------------------------------------

class VerifiedOnly(Policy):
    """Acceptance from the verified positions only (no hindsight): position i learns from rounds with w >= i."""

    def resolve(self, job, proposal, tokens):
        return []

    def observe(self, items, ms=None):
        super().observe(items, ms)
        if not hasattr(self, "seen"):
            self.seen = [self.weight] * len(self.sums)
        fade = self.fade(len(items))
        for _, _, rnd in items:
            for i in range(len(rnd.drafted)):
                self.seen[i] = fade * self.seen[i] + 1.0
                self.sums[i] = fade * self.sums[i] + (i < rnd.accepted)
            self.count += bool(rnd.drafted)

    @property
    def rates(self):
        return [s / n for s, n in zip(self.sums, getattr(self, "seen", [self.weight] * len(self.sums)))]


class NoRestart(Policy):
    """A request goes on from the last request's estimate."""

    def start(self, job, last_token):
        self.jobs[job] = [[last_token], []]
        self.ar_rounds = 0


class FadePerProposal(Policy):
    """Older proposals fade by DECAY per resolved proposal, whatever the job count."""

    def fade(self, jobs):
        return DECAY


class NoProbe(Policy):
    """While AR wins, never probe."""

    def gap(self, jobs):
        return 1 << 30


class NoPlain(Policy):
    """Every request drafts."""

    def plain(self, jobs):
        self.request = 0
        return False


def variant(cls=Policy, costs=RoundCosts, learn: bool = True):
    def make(c: R.Costs, block_size: int):
        p = cls(block_size, R.start_table(c, block_size), learn_costs=learn)
        if costs is not RoundCosts:
            p.costs = costs(p.costs.table, learn)
        return p
    return make


ROWS = {"auto": ("`auto`", variant()),
        "exl3": ("exllamav3 1.6.5's window", exl3_window),
        "-hindsight": ("- hindsight (acceptance from verified positions only)", variant(VerifiedOnly)),
        "-restart": ("- a request starts from the long-run rates", variant(NoRestart)),
        "-fade": ("- fading by DECAY ** jobs (DECAY per proposal)", variant(FadePerProposal)),
        "-learn": ("- online cost learning (the static policy: timed table + acceptance)", variant(learn=False)),
        "-probe": ("- probing while AR wins", variant(NoProbe)),
        "-plain": ("- plain requests", variant(NoPlain))}



class NoBackoff(Policy):
    """Probes always at the budget's spacing, never sooner."""

    def observe(self, items, ms=None):
        super().observe(items, ms)
        self.every = 1 << 16


ROWS["-backoff"] = ("- probing soon after a width won, then backing off", variant(NoBackoff))


class NoEarlyProbe(Policy):
    """A fresh policy waits the budget's spacing for its first probe, as after any AR stretch."""

    def could_pay(self, jobs):
        return False


ROWS["-early"] = ("- a fresh policy's probe on its first round", variant(NoEarlyProbe))


class LearnsPrefillBlocks(Policy):
    """The exllamav3 backend before it kept prefill blocks from the policy: each job's prefill round also resolved a
    proposal that never matched (as exllamav3's prefill iterate did on a GPU)."""

    def observe(self, items, ms=None):
        fade = self.fade(len(items))
        for job, _, rnd in items:
            if rnd.prefill and job in self.jobs:
                self.learn(0, fade)
        super().observe(items, ms)


ROWS["-prefill"] = ("- keeping exllamav3's prefill blocks from the policy (each learnt as a miss)", variant(LearnsPrefillBlocks))


class UnscaledCosts(RoundCosts):
    """The table's values as timed, whatever the live AR rounds say of the load it was timed under."""

    def rescale(self, jobs, got):
        return False


ROWS["-scale"] = ("- scaling a table timed under heavier load to the live AR step", variant(costs=UnscaledCosts))


def kept_costs(c: R.Costs, block_size: int) -> Policy:
    """A new policy whose round costs are those the earlier policies of this replay learnt (the app's turns: each
    starts its acceptance afresh, the machine's round costs carry)."""
    p = variant()(c, block_size)
    kept = getattr(c, "kept_costs", None)
    if kept is None:
        c.kept_costs = p.costs
    else:
        p.costs = kept
    return p
