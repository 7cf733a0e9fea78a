"""Timing of exllamav3's Generator loop over an Exl3Backend's models, for the experiments.

`run_jobs` drives the bare `Generator.iterate()` loop the way `Exl3Backend.generate_many` does, with the toolkit's
capture hook on or off and the Round assembly on or off, and times each part: the unhooked library loop is the
baseline that the hook's and the Round assembly's overhead is measured against. Measurement only, so it lives
here and the backend stays free of counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round
from toolkit.exl3.hook import JobTrack, build_round


@dataclass
class Loop:
    """What one run of the loop emitted and how long its parts took."""

    tokens: list[list[int]] = field(default_factory=list)          # emitted ids per job
    rounds: list[tuple[int, Round]] = field(default_factory=list)  # (job index, Round) when rounds were assembled
    iterations: int = 0                                            # iterate() calls
    seconds: float = 0.0                                           # wall time of the loop, after enqueue
    overhead_s: float = 0.0                                        # of which the capture and the Round assembly
    iterate_s: list[float] = field(default_factory=list)           # per iterate() call
    post_s: list[float] = field(default_factory=list)              # per iterate(): the Round assembly after it
    capture_error: str | None = None                               # first capture problem, with keep_going


def assemble(gen, jobs: list, tracks: list[JobTrack], t_round_ms: float, loop: Loop, keep_going: bool) -> None:
    """generate_many's per-round work: each job's new ids and the drafted block become a Round."""
    for job, tr in zip(jobs, tracks):
        ids = job.sequences[0].sequence_ids
        n = len(ids)
        if n == tr.seen:
            continue
        new = ids.torch_slice(tr.seen, n).reshape(-1).tolist()
        try:
            rnd = build_round(tr, new, job.draft_stats, gen.drafted.get(id(job)), gen.t_draft_ms, t_round_ms)
        except RuntimeError as e:
            if not keep_going:
                raise
            loop.capture_error = loop.capture_error or str(e)[:300]   # a finding, not a reason to stop
            tr.seen, tr.stats_seen = n, len(job.draft_stats)
            continue
        if rnd is not None:
            loop.rounds.append((tr.index, rnd))


def run_jobs(be, prompts: list[list[int]], settings: GenSettings, speculative: bool = True, hooked: bool = True,
             rounds: bool = True, max_steps: int | None = None, keep_going: bool = False) -> Loop:
    """Run prompts as concurrent jobs of the backend's generator until they finish (or for max_steps iterate()
    calls). hooked=False runs exllamav3's own Generator (no capture, so no Rounds); rounds=False skips the
    Round assembly. keep_going records a capture error instead of raising it."""
    gen = be.generator(be.draft_width(settings, speculative), hooked=hooked)
    jobs = be._jobs(prompts, settings)
    tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
    rounds = rounds and hooked
    loop = Loop()
    gen.enqueue(jobs)
    start = time.perf_counter()
    try:
        while gen.num_remaining_jobs() and (max_steps is None or loop.iterations < max_steps):
            t0 = time.perf_counter()
            results = gen.iterate()
            t1 = time.perf_counter()
            for r in results:
                if r.get("stage") == "error":
                    raise RuntimeError(f"exllamav3 job failed: {r.get('error')!r}")
            if rounds:
                assemble(gen, jobs, tracks, (t1 - t0) * 1000.0, loop, keep_going)
            post = time.perf_counter() - t1
            loop.iterations += 1
            loop.iterate_s.append(t1 - t0)
            loop.post_s.append(post)
            loop.overhead_s += post + getattr(gen, "capture_s", 0.0)
    finally:
        loop.seconds = time.perf_counter() - start
        if gen.num_remaining_jobs():          # stopped early: free the jobs' pages
            gen.clear_queue()
    loop.tokens = [j.sequences[0].sequence_ids.torch().reshape(-1).tolist()[len(p):] for j, p in zip(jobs, prompts)]
    return loop
