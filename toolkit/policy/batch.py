"""The drafting policy on exllamav3: one verify width per iterate() for all jobs, round costs timed per concurrency.

exllamav3 verifies a rectangular window (every job the same width), so the width is chosen once per iterate for
the current number of jobs, from the cost curve t_round(w, c) of that concurrency, among the widths the table
measured and the cost probes' coarse ones (`BatchPolicy.set_concurrency`: their shapes' CUDA graphs exist).
Acceptance is pooled: each job keeps its own `Hindsight` (its proposals resolve against its own emitted tokens)
and all of them feed the one `Acceptance` of the policy, which belongs to the backend and drafter pair and learns
across generate calls.

Costs come from exl3_calibrate.calibrate (its docstring says how they are timed), once per concurrency at first
use, cached per model pair, GPU, options and concurrency through runtime/policy.cached_costs.

That table is only the prior (`learn_costs`, on by default; the backend's `learn_costs` attribute turns it off).
Every decoding iterate() whose jobs all emitted and none was prefilling is timed into runtime/learned_costs.py
under (concurrency, the width asked), which corrects the curve per width: warm-up rounds after a change of width
or job count are not learnt from, a settled width costs a low quantile of its recent rounds, other widths follow
the table scaled by their settled neighbours, and the curve stays non-decreasing (that module's docstring has the
rules). The width in use is left only for one expected to give `SWITCH_MARGIN` more tokens per ms, so noise in
the costs does not make the policy churn (each new width pays warm-up rounds). A policy sees only the widths it
picks, so while drafting it also makes cost probes, at most one every `explore_every` drafting rounds, over the
coarse widths of `probe_widths` (2^k - 1 and B-1, so that few shapes ever need warming up): B-1 while it is wider
than every settled width and would beat the current width w even at w's cost; the widest coarse width up to half
the narrowest settled one while it would beat w even at an AR step's cost; w = 0 (AR) while its cost was never
settled and it would beat w even at `AR_FLOOR` of w's cost (a table too dear at every width holds every drafting
width up to its AR entry, so while only drafting rounds are seen, drafting at a loss would look like a gain). A
probe verifies its width for `PROBE_ROUNDS` rounds at most, until that width settles (the warm-up rounds and
`min_seen` kept ones); each still emits the target's own tokens. Once the ends are settled (again after they go
stale) probing stops. Fixed-width runs learn and probe nothing.

A (jobs, width) shape costs more in its first `NEW_SHAPE_ROUNDS` rounds: exllamav3 runs it eagerly, captures its
CUDA graphs, then replays them (2026-12-05, H200, c = 8: `auto`'s cold first repetition ran 0.46x B=16 while it
met ~6 widths at each job count as answers ended). The backend counts the rounds run per shape (`shapes`, kept by
its Generator, calibration included), and the policy charges a width whose shape is not yet warm at the current
job count its warm-up rounds still to run, at the median excess measured on earlier new shapes (NEW_SHAPE_PRIOR
rounds of that width before two were measured), spread over the rounds it may run at that job count: those before
the job closest to its max_new_tokens ends (`HORIZON` at most), plus as many as ran at that job count before. So
the policy leaves a warm width only for one that repays its capture, a job count seen for the first time (one of
a batch's last jobs) keeps to few shapes, and one that keeps coming back (one job in a chat app) soon explores
freely; at a change of job count every shape is new, all widths pay alike, and the width in use stays unless
another wins by SWITCH_MARGIN.

The policy's AR rounds run on the speculative Generator, which keeps the drafter's K/V up to date: on the real
shape they cost 1.09-1.34x a plain AR step (docs/performance.md), too much for "never more than 5 % slower than
AR" where drafting cannot win. So requests are judged whole too: a request that settled on AR (`AR_REQUEST_SHARE`
of its rounds AR, and at its end AR's measured cost beating every drafting width by `AR_REQUEST_MARGIN` at its
job count) sends the next 1, then 4, then 16 (`AR_RUN_GROWTH`, `MAX_AR_REQUESTS`) requests of as many jobs to the
drafter-less Generator (`plain_request`), and a request that drafted ends the runs. A losing drafter then costs about 1/(run + 1) of the extra (3 % over
40 requests of 25 % dearer AR rounds on the stand-in, tests/test_exl3_plain_requests.py).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Hashable, Sequence

from ..runtime.events import Round
from ..exl3.calibrate import CALIBRATION_WARM
from .learned import MIN_SEEN, WARMUP, LearnedCosts, as_ms
from .policy import Hindsight, Policy

EXPLORE_EVERY = 32                 # drafting rounds between two cost probes, at least
EXPLORE_MARGIN = 0.02              # a probed width must promise this much more tokens per ms than the current one
SWITCH_MARGIN = 0.03               # leave the width in use only for one promising this much more tokens per ms
PROBE_ROUNDS = WARMUP + MIN_SEEN + 1   # rounds a cost probe runs at most: enough for its width to settle
AR_FLOOR = 0.5                     # an AR round costs at least this share of a drafting round (cost probes of w=0)
NEW_SHAPE_ROUNDS = CALIBRATION_WARM    # rounds of a new (jobs, width) shape that cost more than its later ones
NEW_SHAPE_PRIOR = 4.0              # their cost beyond steady rounds, in rounds of that width, until one is measured
HORIZON = 32                       # rounds ahead, at most, over which a new shape's extra cost is spread
AR_REQUEST_SHARE = 0.75            # a request "settled on AR": this share of its rounds AR ...
AR_REQUEST_MARGIN = 0.05           # ... and AR beating every drafting width by this much tokens per ms
AR_RUN_GROWTH = 4                  # each request in a row that settles on AR makes the next run of plain ones this longer
MAX_AR_REQUESTS = 16               # requests in a row decoded on the drafter-less Generator, at most, before another try


def probe_widths(block_size: int) -> list[int]:
    """The coarse widths cost probes use: 2^k - 1 below B-1, and B-1."""
    return sorted({(1 << k) - 1 for k in range(1, block_size.bit_length() + 1) if (1 << k) - 1 < block_size - 1}
                  | {block_size - 1})


class BatchPolicy(Policy):
    """A `Policy` for a batching engine: per-job hindsight, pooled acceptance, one width per round of all jobs."""

    def __init__(self, *a, explore_every: int = EXPLORE_EVERY, shapes: Counter | None = None, **kw):
        kw.setdefault("learn_costs", True)
        self.shapes = shapes                      # (jobs, width) -> rounds run (None: every shape counts as warm)
        self.left: int | None = None              # tokens the closest-to-done job may still emit (None: unknown)
        self._past: int | None = None             # `past`, counted once per round when a cold width needs it
        self.excess: deque = deque(maxlen=16)     # ms a new shape's round took beyond the curve's steady cost
        self.excess_median = 0.0                  # their median, taken when one is added (every round prices it)
        self.request = [0, 0]                     # AR rounds and all decode rounds of the request under way
        self.fallback: dict[int, list[int]] = {}  # jobs per request -> [plain AR requests still to serve, next run]
        self.plain_served = 0                     # requests decoded on the drafter-less Generator so far
        super().__init__(*a, **kw)
        self.jobs: dict[Hashable, Hindsight] = {}
        self.concurrency = None
        self.learned = LearnedCosts() if self.learn_costs and self.fixed_width is None else None
        self.explore_every, self.since_probe, self.asked = explore_every, 0, None
        self.current: int | None = None           # the width in use (hysteresis)
        self.probe, self.probe_left = None, 0     # the cost probe under way: its width, rounds left

    def begin_job(self, key: Hashable, last_prompt_token: int) -> None:
        """A job starts: its first round's proposal predicts the tokens after `last_prompt_token`."""
        self.jobs[key] = Hindsight(last_prompt_token)

    def end_job(self, key: Hashable) -> None:
        self.jobs.pop(key, None)                  # its unresolved proposals are censored

    def use_concurrency(self, c: int, left: int | None = None) -> None:
        """The next round has `c` jobs; the closest to its max_new_tokens may still emit `left` tokens."""
        self.left = left
        if c != self.concurrency:
            self.concurrency, self.probe = c, None
            self.set_concurrency(c)
        self._past = None

    @property
    def past(self) -> int:
        """Rounds run at the current job count so far, every width (counted only when a cold width is priced)."""
        if self._past is None:
            c = self.concurrency or 1
            self._past = sum(n for (j, _), n in self.shapes.items() if j == c) if self.shapes else 0
        return self._past

    def plain_request(self, jobs: int) -> bool:
        """Whether a request of `jobs` jobs should decode on the drafter-less Generator: recent requests of that
        many jobs settled on AR, whose rounds on the speculative Generator cost more than plain AR steps (the
        drafter's K/V follows the target; 1.09-1.34x on the real shape). Counts the request down when so."""
        state = self.fallback.get(jobs)
        if state is None or state[0] <= 0:
            return False
        state[0] -= 1
        self.plain_served += 1
        return True

    def begin_request(self) -> None:
        self.request = [0, 0]

    def end_request(self, jobs: int) -> None:
        """A speculative request of `jobs` jobs ended: if it settled on AR, the next 1, 4, 16 (AR_RUN_GROWTH,
        MAX_AR_REQUESTS) such requests decode plain AR, so a drafter that loses costs about 1/(run + 1) of the
        extra (under 2 % at 16 runs of 30 % dearer AR rounds); a request that drafted starts the run again at 1."""
        ar, rounds = self.request
        state = self.fallback.setdefault(jobs, [0, 1])
        if rounds and ar >= AR_REQUEST_SHARE * rounds and self.ar_wins(jobs):
            state[0], state[1] = state[1], min(AR_RUN_GROWTH * state[1], MAX_AR_REQUESTS)
        elif rounds:
            state[0], state[1] = 0, 1

    def ar_wins(self, jobs: int) -> bool:
        """Whether AR beats every drafting width of the menu by AR_REQUEST_MARGIN at `jobs` jobs, with AR's cost
        measured there (learned, not only tabled) when costs are learnt: a long run of plain requests learns
        nothing, so it needs a clear loss, not a near tie."""
        self.use_concurrency(jobs)                # judged at the request's job count, not at its last one
        if self.learned is not None and 0 not in self.learned.settled(jobs):
            return False
        s = super().scores()                      # steady costs: a capture still to pay is no reason to give up
        return max(s[w] for w in (self.menu or range(len(s))) if w > 0) < (1 - AR_REQUEST_MARGIN) * s[0]

    def warmup_ms(self, w: int) -> float:
        """What width w still costs at this job count beyond its steady rounds: its shape's warm-up rounds not yet
        run (an eager run, a CUDA graph capture, the first replay), each at the measured excess of such rounds
        (the median of the last ones), or at NEW_SHAPE_PRIOR rounds of w in all while fewer than two were measured."""
        if self.shapes is None:
            return 0.0
        todo = max(0, NEW_SHAPE_ROUNDS - self.shapes.get((self.concurrency or 1, w), 0))
        if not todo:
            return 0.0
        per = self.excess_median if len(self.excess) >= 2 else NEW_SHAPE_PRIOR * self.t[w] / NEW_SHAPE_ROUNDS
        return todo * max(per, 0.0)

    def amortized(self, w: int, expected: float) -> float:
        """warmup_ms(w) per round over the rounds width w may run at this job count: those before the closest job
        ends (HORIZON at most: answers often stop early), and as many again as ran at this job count before (a job
        count that keeps coming back, such as one job in a chat app, soon makes a capture cheap)."""
        extra = self.warmup_ms(w)
        if not extra:
            return 0.0
        ahead = HORIZON if self.left is None else min(HORIZON, self.left / max(expected, 1.0))
        return extra / max(1.0, ahead + self.past)

    def scores(self) -> list[float]:
        """Expected tokens per ms for each width, a shape not yet warm at this job count charged its warm-up rounds
        spread over the rounds ahead (`amortized`): switching to it pays only if it keeps paying until then. Only
        the menu's widths are charged (best() picks among them; the others are never run)."""
        E, menu = self.acceptance.expected_tokens(), set(self.menu or range(self.block_size))
        return [e / (t + self.amortized(w, e)) if w in menu else e / t for w, (e, t) in enumerate(zip(E, self.t))]

    def set_concurrency(self, concurrency: int) -> None:
        """Policy.set_concurrency, with the widths to pick from cut to those the table measured at `concurrency`
        and the cost probes' coarse widths: the calibration ran their (jobs, width) shapes and captured their CUDA
        graphs (a probe does so once), where any other width's first rounds would run eagerly and capture a graph
        of their own, mid-answer."""
        if self.costs is not None:
            measured = {w for w in self.costs.widths(concurrency) if w < self.block_size}
            menu = sorted(measured | set(probe_widths(self.block_size)) | {0})
            if menu != self.menu:
                self.menu, self._best = menu, None         # best() caches by acceptance and costs, not by menu
        super().set_concurrency(concurrency)

    def rescale(self, drift: float = 1.0) -> None:
        """The cost curve in use: the table's at this concurrency, corrected by the learned costs when learning."""
        learned = getattr(self, "learned", None)          # None while Policy.__init__ runs
        if learned is None:
            return super().rescale(drift)
        t = learned.curve(self.concurrency or 1, self.table)
        if t != getattr(self, "t", None):
            self.t, self.version = t, self.version + 1
            self.space_probes()

    def best(self) -> int:
        """The menu's width with the most expected tokens per ms (`scores`; ties go to the narrower one), with
        hysteresis: the width in use stays unless the best beats it by SWITCH_MARGIN."""
        s, cur = self.scores(), self.current
        b = max(self.menu or range(len(s)), key=lambda w: (s[w], -w))
        if cur is not None and cur != b and cur < self.block_size and s[b] <= (1 + SWITCH_MARGIN) * s[cur]:
            b = cur
        self.current = b
        return b

    def width(self) -> int:
        """The verify width of the next iterate: the policy's, or a cost probe's (module docstring)."""
        if self.probe is not None:
            if self.probe_left > 0 and self.probe not in self.learned.settled(self.concurrency or 1):
                self.probe_left -= 1
                self.asked = self.probe
                return self.probe
            self.probe = None
        w = super().width()
        if self.learned is not None and w > 0 and not self.probing:
            self.since_probe += 1
            if self.since_probe >= self.explore_every:
                e = self.cost_probe(w)
                if e != w:
                    self.since_probe, self.probe, self.probe_left, w = 0, e, PROBE_ROUNDS - 1, e
        self.asked = w
        return w

    def cost_probe(self, w: int) -> int:
        """A coarse width whose cost is only extrapolated and which could beat w at the least it may cost; else w."""
        c, E, t = self.concurrency or 1, self.acceptance.expected_tokens(), self.t
        seen = [x for x in self.learned.settled(c) if x > 0] or [w]
        bar = (1 + EXPLORE_MARGIN) * E[w] / (t[w] + self.amortized(w, E[w]))
        wide = self.block_size - 1
        narrow = max((x for x in probe_widths(self.block_size) if x <= min(seen) // 2), default=0)
        if wide > max(seen) and wide != w and E[wide] / (t[w] + self.amortized(wide, E[wide])) > bar:
            return wide
        if 0 < narrow != w and E[narrow] / (t[0] + self.amortized(narrow, E[narrow])) > bar:
            return narrow
        if 0 not in self.learned.settled(c) and 1 / (AR_FLOOR * t[w] + self.amortized(0, 1.0)) > bar:
            return 0                              # AR never timed, and it could win at the least it may cost
        return w

    def cost_report(self) -> dict:
        """ms per width per concurrency: the table's curve ("start"), the one in use ("learned", = start when not
        learning) and the observed rounds (cost, kept and warm-up rounds per width) behind it."""
        lc = self.learned
        cs = sorted(set(self.costs.ms) | set(lc.rounds if lc else ()))
        start = {c: self.costs.curve(self.block_size, c) for c in cs}
        out = {"start": {c: as_ms(v) for c, v in start.items()},
               "learned": {c: as_ms(lc.curve(c, v) if lc else v) for c, v in start.items()}}
        if lc is not None:
            out["observed"] = {c: lc.observed(c) for c in sorted(lc.rounds)}
        if self.excess:
            out["new_shape_excess_ms"] = round(self.excess_median, 3)   # per warm-up round
        if self.plain_served:
            out["plain_ar_requests"] = self.plain_served
        return out

    def observe_round(self, items: Sequence[tuple[Hashable, Sequence[int], Round]], ms: float | None = None) -> None:
        """Learn from one iterate(): (job key, its full proposal or (), its Round) for every job that emitted, and
        with `ms` the iterate's time (a cost observation when every job emitted a decoding round)."""
        if not items:
            return
        drafted, accepted = False, 0
        for key, proposal, rnd in items:
            h = self.jobs.get(key)
            if h is None:
                continue
            for length in h.add(proposal, rnd.tokens):
                self.acceptance.update(length)
            drafted = drafted or bool(rnd.drafted)
            accepted = max(accepted, rnd.accepted)
        if self.fixed_width is not None:
            return
        c = self.concurrency or len(items)
        decoding = not any(r.prefill for _, _, r in items)
        if self.learned is not None and ms and len(items) == c and decoding:
            width = self.asked if self.asked is not None else max(len(r.drafted) for _, _, r in items)
            if self.shapes is not None and self.shapes.get((c, width), 0) <= NEW_SHAPE_ROUNDS:
                self.excess.append(ms - self.t[width])        # a warm-up round of its shape (counted with this one)
                self.excess_median = statistics.median(self.excess)
            self.learned.observe(c, width, ms)
            self.rescale()
        self.asked = None
        if decoding:
            self.request[0] += not drafted
            self.request[1] += 1
        self.ar_rounds = 0 if drafted else self.ar_rounds + 1
        if self.probing and self.best() == 0:
            self.back_off(accepted)
        self.probing = False
