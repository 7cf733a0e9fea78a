"""Capture of the drafted block per job per round from exllamav3's Generator (its seams: exl3/seams.py).

exllamav3 keeps only counts: `record_draft_stats=True` appends (position, window, accepted) to
`job.draft_stats` each verification round, but the drafted ids themselves live in a shared pinned buffer
that the next round overwrites. The smallest capture point is the return value of
`Generator.iterate_draftmodel_dflash_gen` (`iterate_draftmodel_mtp_gen` when the target's own MTP head drafts):
a host tensor [rows, window] whose rows are the prefilled active jobs in `active_jobs` order (the same order
`iterate_gen` verifies them in). A subclass copies it and the drafting time; everything else is rebuilt from the
job's own sequence ids after `iterate()`.

The same subclass sets the verify width per round, which is how the drafting policy runs on exllamav3 without
rebuilding the Generator: each `iterate()` drafts `row_limited(num_draft_tokens)` ids (0 = a plain decode step
with no drafter call; the drafter's K/V still follows the target's taps), so `set_width(w)` before a round
chooses it. The DFlash drafter always runs its whole block whatever the window, so with `full` set the hook asks
exllamav3 for the full B-1 columns, keeps all of them as the round's proposal (hindsight acceptance needs every
position) and hands back only the first w for verification. The MTP head drafts one id per step, so there `full`
costs B-1 steps: what a policy's proposal costs on it, timed as such.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core.errors import ToolkitError
from ..runtime import trace
from ..runtime.events import Round

HOOKED = "iterate_draftmodel_dflash_gen"
HOOKED_MTP = "iterate_draftmodel_mtp_gen"      # the MTP head's drafting step (absent: no --draft mtp capture)


def recording_generator_class(generator_cls: type) -> type:
    """A Generator subclass with a per-round verify width (`set_width`) that keeps each round's verified ids and
    full proposal per job (keyed by id(job)) and the drafting time."""
    if not callable(getattr(generator_cls, HOOKED, None)):
        raise ToolkitError(f"exllamav3's Generator has no {HOOKED}(): this exllamav3 does not fit the toolkit")

    class RecordingGenerator(generator_cls):
        drafted: dict = {}                # id(job) -> the ids verified this round
        proposals: dict = {}              # id(job) -> every id the drafter proposed this round
        full_window: int | None = None    # with a policy: columns to take from the drafter (B-1)
        t_draft_ms: float = 0.0

        def set_width(self, width: int, full: int | None = None) -> None:
            """Verify `width` drafts per job from the next iterate() on (0 = AR); keep `full` proposed ids."""
            self.num_draft_tokens, self.full_window = width, full

        def iterate(self):
            self.drafted, self.proposals, self.t_draft_ms = {}, {}, 0.0
            if not trace.LISTENERS:
                return super().iterate()
            jobs = list(self.active_jobs)
            before = [len(j.sequences[0].sequence_ids) for j in jobs]
            width = self.num_draft_tokens if self.draft_model is not None else 0
            t0 = time.perf_counter()
            out = super().iterate()
            ms = (time.perf_counter() - t0) * 1000.0
            trace.emit("iterate", t=t0, w=width, rows=sum(1 for j in jobs if j.is_prefill_done()), jobs=len(jobs),
                       ms=ms, emitted=sum(len(j.sequences[0].sequence_ids) - b for j, b in zip(jobs, before)))
            return out

        def iterate_draftmodel_dflash_gen(self, results, window):
            return self.capture(super().iterate_draftmodel_dflash_gen, results, window)

        def iterate_draftmodel_mtp_gen(self, results, window):
            return self.capture(super().iterate_draftmodel_mtp_gen, results, window)

        def capture(self, draft, results, window):
            """Run exllamav3's drafting step `draft` for the full window, keep its ids, hand back the first `window`."""
            full = max(self.full_window or 0, window)
            t0 = time.perf_counter()
            ids = draft(results, full)                    # host tensor, filled synchronously
            t1 = time.perf_counter()
            self.t_draft_ms = (t1 - t0) * 1000.0
            if ids is not None:
                rows = [job for job in self.active_jobs if job.is_prefill_done()]
                block = ids[: len(rows)].tolist()
                width = min(window, ids.shape[-1])
                self.proposals = {id(job): tuple(r) for job, r in zip(rows, block)}
                self.drafted = {id(job): tuple(r[:width]) for job, r in zip(rows, block)}
                ids = ids[:, :width]
            return ids

    RecordingGenerator.__name__ = RecordingGenerator.__qualname__ = "RecordingGenerator"
    return RecordingGenerator


def set_policy_width(gen, drive, full: int) -> None:
    """Verify the width a policy's drive picks in the next round of `gen` (keeping `full` proposed ids); trace
    listeners also see what the choice saw: the acceptance estimate and the cost curve."""
    n = gen.num_remaining_jobs()
    gen.set_width(drive.width(n), full)
    if trace.LISTENERS:
        trace.emit("policy", jobs=n, w=gen.num_draft_tokens, **drive.choice(n))


@dataclass
class JobTrack:
    """What is known about one job between rounds: emitted length and how many draft_stats entries were read."""

    index: int
    prompt_len: int
    seen: int = 0                     # sequence length already turned into Rounds
    stats_seen: int = 0
    rounds: list[Round] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seen = self.seen or self.prompt_len


def build_round(
    track: JobTrack,
    new: list[int],
    draft_stats: list[tuple[int, int, int]],
    drafted: tuple[int, ...] | None,
    t_draft_ms: float,
    t_round_ms: float,
    proposed: int | None = None,
) -> Round | None:
    """The Round a job made in one iterate(), from the ids it appended and its draft_stats; None if it emitted nothing.

    `drafted` is what the job verified this round (its window w may change from round to round; a round without
    a verification record is an AR round, also inside a speculative run); `proposed` how many ids the drafter
    proposed (B-1 under a policy; default: the verified window).

    The first round of a job is marked prefill: exllamav3 ingests the prompt in that iterate() and, with a
    drafter, already verifies a drafted block there (so unlike the torch loop it may carry drafted ids).
    """
    stats = draft_stats[track.stats_seen:]
    if not new:
        if stats:
            raise RuntimeError(f"job {track.index}: draft_stats grew but no token was emitted")
        return None
    prefill = track.seen == track.prompt_len
    if stats:
        if len(stats[0]) != 3:
            raise ToolkitError(f"exllamav3 records {len(stats[0])} fields per verification round, the toolkit reads 3 "
                               "(position, window, accepted): this exllamav3 does not fit the toolkit")
        if len(stats) != 1 or drafted is None:
            state = "missing" if drafted is None else "present"
            raise RuntimeError(f"job {track.index}: {len(stats)} verification records in one round, drafted ids {state}")
        _, window, accepted = stats[0]
        block = tuple(drafted[:window])
        if len(new) != accepted + 1 or list(block[:accepted]) != new[:accepted]:
            raise RuntimeError(
                f"job {track.index}: round capture out of step (accepted {accepted}, emitted {len(new)} tokens, "
                f"drafted {list(block[:accepted + 1])} vs emitted {new})"
            )
        r = Round(block, accepted, new[-1], t_draft_ms, max(t_round_ms - t_draft_ms, 0.0), prefill,
                  max(proposed or 0, len(block)))
    else:
        if len(new) != 1:
            raise RuntimeError(f"job {track.index}: {len(new)} tokens emitted in a round without a verified draft")
        r = Round((), 0, new[0], 0.0, t_round_ms, prefill)
    track.seen += len(new)
    track.stats_seen = len(draft_stats)
    track.rounds.append(r)
    return r
