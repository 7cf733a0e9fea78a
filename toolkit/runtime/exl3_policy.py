"""The drafting policy on exllamav3: one verify width per iterate() for all jobs, round costs timed per concurrency.

exllamav3 verifies a rectangular window (every job the same width), so the width is chosen once per iterate for
the current number of jobs, from the cost curve t_round(w, c) of that concurrency. Acceptance is pooled: each
job keeps its own `Hindsight` (its proposals resolve against its own emitted tokens) and all of them feed the one
`Acceptance` of the policy, which belongs to the backend and drafter pair and learns across generate calls.

Costs come from `time_rounds`: steady-state iterate() rounds of `c` dummy jobs (prompts of `context` ids, no
stop tokens) at fixed widths, interleaved width by width so drift spreads evenly, median per width. The backend
runs it once per concurrency at first use (`calibrate`) and caches the table per model pair, GPU, options and
concurrency through runtime/policy.cached_costs; the benchmark and experiments/speed.py use the same timer with
more repetitions.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence

from ..core.errors import ToolkitError
from .backend import GenSettings
from .events import Round
from .policy import Hindsight, Policy

PAGE = 256                         # exllamav3's cache page size
CALIBRATION_WIDTHS = (0, 1, 3, 5, 7, 11, 15)
CALIBRATION_REPS = 5
CALIBRATION_CONTEXT = 256


def calibration_widths(block_size: int, widths: Sequence[int] = CALIBRATION_WIDTHS) -> list[int]:
    """The widths to time for a drafter of block B: `widths` clipped to B-1 (0, the AR step, always)."""
    return sorted({0} | {min(w, block_size - 1) for w in widths if w >= 0})


class BatchPolicy(Policy):
    """A `Policy` for a batching engine: per-job hindsight, pooled acceptance, one width per round of all jobs."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.jobs: dict[Hashable, Hindsight] = {}
        self.concurrency = None

    def begin_job(self, key: Hashable, last_prompt_token: int) -> None:
        """A job starts: its first round's proposal predicts the tokens after `last_prompt_token`."""
        self.jobs[key] = Hindsight(last_prompt_token)

    def end_job(self, key: Hashable) -> None:
        self.jobs.pop(key, None)                  # its unresolved proposals are censored

    def use_concurrency(self, c: int) -> None:
        if c != self.concurrency:
            self.concurrency = c
            self.set_concurrency(c)

    def observe_round(self, items: Sequence[tuple[Hashable, Sequence[int], Round]]) -> None:
        """Learn from one iterate(): (job key, its full proposal or (), its Round) for every job that emitted."""
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
        self.ar_rounds = 0 if drafted else self.ar_rounds + 1
        if self.probing and self.best() == 0:
            self.back_off(accepted)
        self.probing = False


def dummy_prompts(concurrency: int, context: int, vocab: int) -> list[list[int]]:
    """Distinct prompts of `context` ids per job (no shared pages between the jobs)."""
    vocab = max(vocab, 2)
    return [[(7 * i + 13 * j + 3) % vocab for i in range(context)] for j in range(concurrency)]


def time_rounds(be, concurrency: int, widths: Sequence[int], reps: int = CALIBRATION_REPS, warm: int = 1,
                context: int = CALIBRATION_CONTEXT, speculative: bool = True, full: bool = True) -> dict[int, list[float]]:
    """ms of steady-state iterate() rounds of `concurrency` dummy jobs on an Exl3Backend, per verify width.

    speculative=False times the plain AR generator (no drafter; widths ignored, one list under 0). With full=True
    the rounds capture the drafter's whole block as the policy's rounds do. One untimed round per width first
    (`warm` passes), then `reps` passes over the widths; a pass stops early if a job runs out of tokens.
    """
    widths = [0] if not speculative else list(widths)
    B = be.block_size
    gen = be.generator(max(widths) if speculative else 0)
    need = (warm + reps) * sum(w + 1 for w in widths) + 2 * B          # every draft accepted, at worst
    room = min(be.cache_tokens // max(concurrency, 1) // PAGE * PAGE, be.max_context) - B - 1
    context = max(1, min(context, room - need))
    max_new = min(need, room - context)
    if max_new < 2:
        raise ToolkitError(f"timing {concurrency} jobs: the cache of {be.cache_tokens} tokens is too small (raise cache_tokens)")
    settings = GenSettings(max_new_tokens=max_new, block_size=None, stop_ids=())
    jobs = be._jobs(dummy_prompts(concurrency, context, be.vocab_size), settings)
    times: dict[int, list[float]] = {w: [] for w in widths}
    gen.enqueue(jobs)
    try:
        if speculative:
            gen.set_width(0, B - 1 if full else None)
        for _ in range(64 + concurrency * context // 256):     # prefill, until every job has emitted a token
            if not any(len(j.sequences[0].sequence_ids) <= context for j in jobs):
                break
            gen.iterate()
        else:
            raise ToolkitError(f"timing {concurrency} jobs: the dummy prompts did not finish prefilling")
        for p in range(warm + reps):
            for w in widths:
                if gen.num_remaining_jobs() < concurrency:
                    break
                if speculative:
                    gen.set_width(w, B - 1 if full else None)
                be.sync()
                t0 = be.clock()
                gen.iterate()
                be.sync()
                if p >= warm:
                    times[w].append((be.clock() - t0) * 1000.0)
    finally:
        if gen.num_remaining_jobs():
            gen.clear_queue()
    missing = [w for w, ts in times.items() if not ts]
    if missing:
        raise ToolkitError(f"timing {concurrency} jobs: no round measured at width {missing[0]} "
                           f"(the cache of {be.cache_tokens} tokens is too small; raise cache_tokens)")
    return times


def medians(times: dict[int, list[float]]) -> dict[int, float]:
    return {w: statistics.median(ts) for w, ts in times.items()}


def calibrate(be, concurrency: int, reps: int = CALIBRATION_REPS, context: int = CALIBRATION_CONTEXT,
              widths: Sequence[int] | None = None) -> dict[int, float]:
    """Median ms per round at each calibration width for `concurrency` jobs (w = 0: an AR round of the
    speculative generator, drafter K/V kept up to date, which is what the policy's AR rounds cost)."""
    ws = calibration_widths(be.block_size, CALIBRATION_WIDTHS if widths is None else widths)
    return medians(time_rounds(be, concurrency, ws, reps=reps, context=context))

