"""The exllamav3 policy's prior round costs t_round(w, c), timed on the loaded pair.

`calibrate` times steady-state iterate() rounds of `c` dummy jobs (prompts of `context` ids, no stop tokens) at
fixed widths, interleaved width by width so drift spreads evenly, and keeps the low quartile per width (host
jitter only adds to a round), after `CALIBRATION_WARM` untimed passes: every (c, w) shape has run eagerly and had
its CUDA graph captured, so the table times replayed rounds, as decoding sees them. Then the smaller batches a
request's last jobs leave run once at every width, so that their first-use work happens here too. The
backend runs it once per concurrency at first use and caches the table per model pair, GPU, options and
concurrency (costs/cache.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..core.errors import ToolkitError
from ..runtime import trace
from ..runtime.backend import GenSettings

PAGE = 256                         # exllamav3's cache page size
CALIBRATION_WIDTHS = (0, 1, 3, 5, 7, 11, 15)
CALIBRATION_REPS = 5
CALIBRATION_WARM = 3               # untimed passes before timing: a new shape runs eagerly, then captures, then replays
CALIBRATION_CONTEXT = 256
SPOT_REPS = 3                      # rounds per width when a cached table is checked
TABLE_VERSION = 3                  # of the cached tables' meaning (replayed rounds, their low quartile); in the cache key


def low_quartile(xs: Sequence[float]) -> float:
    """The 0.25-quantile of xs, linear between the order statistics (host jitter only adds to a round)."""
    v = sorted(xs)
    pos = 0.25 * (len(v) - 1)
    i = int(pos)
    return v[i] if i + 1 >= len(v) else v[i] + (v[i + 1] - v[i]) * (pos - i)


def calibration_widths(block_size: int, widths: Sequence[int] = CALIBRATION_WIDTHS) -> list[int]:
    """The widths to time for a drafter of block B: `widths` clipped to B-1 (0, the AR step, always)."""
    return sorted({0} | {min(w, block_size - 1) for w in widths if w >= 0})


def dummy_prompts(concurrency: int, context: int, vocab: int) -> list[list[int]]:
    """Distinct prompts of `context` ids per job (no shared pages between the jobs)."""
    vocab = max(vocab, 2)
    return [[(7 * i + 13 * j + 3) % vocab for i in range(context)] for j in range(concurrency)]


def time_rounds(be, concurrency: int, widths: Sequence[int], reps: int = CALIBRATION_REPS, warm: int = 1,
                context: int = CALIBRATION_CONTEXT, speculative: bool = True, full: bool = True,
                emitted: dict[int, list[float]] | None = None) -> dict[int, list[float]]:
    """ms of steady-state iterate() rounds of `concurrency` dummy jobs on an Exl3Backend, per verify width.

    speculative=False times the plain AR generator (no drafter; widths ignored, one list under 0). With full=True
    the rounds capture the drafter's whole block as the policy's rounds do. One untimed round per width first
    (`warm` passes), then `reps` passes over the widths (0: warm-up only); a pass stops early if a job runs out of
    tokens. `emitted`, when given, gets the mean tokens each job emitted in every timed round, per width (a round
    that accepts more than decoding does also does more per-token work: the table can rise with w where decoding
    rounds do not).
    """
    widths = [0] if not speculative else list(widths)
    B = be.block_size
    gen = be.generator(max(widths) if speculative else 0)
    need = (warm + reps) * sum(w + 1 for w in widths) + 2 * B     # every draft accepted, at worst
    room = min(be.cache_tokens // max(concurrency, 1) // PAGE * PAGE, be.max_context) - B - 1
    context = max(1, min(context, room - need))
    max_new = min(need, room - context)
    if max_new < 2:
        raise ToolkitError(f"timing {concurrency} jobs: the cache of {be.cache_tokens} tokens is too small (raise cache_tokens)")
    settings = GenSettings(max_new_tokens=max_new, block_size=None, stop_ids=())
    prompts = dummy_prompts(concurrency, context, be.vocab_size)
    jobs = be._jobs(prompts, settings)
    times: dict[int, list[float]] = {w: [] for w in widths}
    gen.enqueue(jobs)
    try:
        if speculative:
            gen.set_width(0, B - 1 if full else None)
        for _ in range(64 + concurrency * context // 256):     # prefill, until every job has emitted a token
            if all(len(j.sequences[0].sequence_ids) > len(p) for j, p in zip(jobs, prompts)):
                break
            gen.iterate()
        else:
            raise ToolkitError(f"timing {concurrency} jobs: the timing prompts did not finish prefilling")
        for p in range(warm + reps):
            if p == warm:
                trace.emit("timed", on=True)             # measurement scripts may profile the timed passes
            for w in widths:
                if speculative:
                    gen.set_width(w, B - 1 if full else None)
                if gen.num_remaining_jobs() < concurrency:
                    break
                before = [len(j.sequences[0].sequence_ids) for j in jobs]
                be.sync()
                t0 = be.clock()
                gen.iterate()
                be.sync()
                if p >= warm:
                    times[w].append((be.clock() - t0) * 1000.0)
                    if emitted is not None:
                        after = [len(j.sequences[0].sequence_ids) for j in jobs]
                        emitted.setdefault(w, []).append(statistics.mean(a - b for a, b in zip(after, before)))
    finally:
        trace.emit("timed", on=False)
        if gen.num_remaining_jobs():
            gen.clear_queue()
    missing = [w for w, ts in times.items() if not ts]
    if reps and missing:
        raise ToolkitError(f"timing {concurrency} jobs: no round measured at width {missing[0]} "
                           f"(the cache of {be.cache_tokens} tokens is too small; raise cache_tokens)")
    return times


def medians(times: dict[int, list[float]]) -> dict[int, float]:
    return {w: statistics.median(ts) for w, ts in times.items()}


def calibrate(be, concurrency: int, context: int = CALIBRATION_CONTEXT, widths: Sequence[int] | None = None,
              emitted: dict[int, float] | None = None, rounds: dict[int, int] | None = None) -> dict[int, float]:
    """ms per round at each calibration width for `concurrency` jobs, the low quartile of its timed rounds (w = 0:
    an AR round of the speculative generator, drafter K/V kept up to date, which is what the policy's AR rounds
    cost); `emitted`, when given, gets the mean tokens a job emitted per round per width, `rounds` how many rounds
    each width timed."""
    ws = calibration_widths(be.block_size, CALIBRATION_WIDTHS if widths is None else widths)
    seen: dict[int, list[float]] = {}
    trace.emit("cell", label=f"calibrate/c{concurrency}")
    try:
        times = time_rounds(be, concurrency, ws, CALIBRATION_REPS, CALIBRATION_WARM, context, emitted=seen)
    finally:
        trace.emit("cell_end")
    ms = {w: low_quartile(ts) for w, ts in times.items()}
    if rounds is not None:
        rounds.update({w: len(ts) for w, ts in times.items()})
    if emitted is not None:
        emitted.update({w: round(statistics.mean(v), 2) for w, v in seen.items()})
    warm_tails(be, concurrency, ws, context)
    return ms


def warm_tails(be, concurrency: int, widths: Sequence[int], context: int = CALIBRATION_CONTEXT) -> None:
    """One untimed round of 1..c-1 jobs at every width: the shapes a batch meets as its jobs finish. exllamav3 does
    first-use work per new batch shape (kernel tuning, compilation); a first round at one such shape took 1.35 s
    on an H100, which would otherwise land in the middle of a request."""
    trace.emit("cell", label=f"calibrate/c{concurrency}/tails")
    try:
        for jobs in range(1, concurrency):
            time_rounds(be, jobs, widths, reps=0, warm=1, context=context)
    finally:
        trace.emit("cell_end")


def spot_check(be, concurrency: int) -> dict[int, float]:
    """ms of the AR step and the widest round at `concurrency`, timed now (the least of a few rounds each): what a
    cached cost table is checked against before it is trusted."""
    ws = calibration_widths(be.block_size, (be.block_size - 1,))
    times = time_rounds(be, concurrency, ws, reps=SPOT_REPS, warm=CALIBRATION_WARM)
    return {w: min(ts) for w, ts in times.items() if ts}
