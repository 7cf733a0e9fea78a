"""exllamav3 1.6.5's drafter K/V path in miniature, for the defer_draft_kv tests (tests/test_exl3_defer.py).

KvFakeGenerator extends the stand-in Generator of exl3_fakes with the split the deferral hooks into: iterate()
starts queued jobs (prefill writes the prompt's drafter K/V), drafts, then iterate_gen verifies and calls
draft_model.update_kv_from_target after sampling with the accepted lengths, one row per job, positions from
cache_seqlens. FakeDrafter keeps {(slot, position): (token, position)} and checks, before every draft pass, that
its cache (and its sliding-window ring, for a recurrent drafter) is current; recurrent checkpoints at page
boundaries check the ring too.
"""

from __future__ import annotations

import torch
from exl3_fakes import FakeGenerator, FakeModel, make_backend, target_next

TAPS = 2


def tap_states(rows: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """The target's tap states of a batch: row (ids, start) -> per tap [rows, len, 3] of (token, position, tap)."""
    n = max(len(ids) for ids, _ in rows)
    out = []
    for t in range(TAPS):
        x = torch.zeros(len(rows), n, 3, dtype=torch.half)
        for r, (ids, start) in enumerate(rows):
            for i, tok in enumerate(ids):
                x[r, i] = torch.tensor([tok, start + i, t])
        out.append(x)
    return out


class FakeRing:
    """A drafter's sliding-window state (SWAState): its position, moved by the draft pass and the updates."""

    def __init__(self, position: int):
        self.position = position


class FakeDrafter(FakeModel):
    """A DFlash drafter's context cache {(slot, position): (token, position)}: update_kv_from_target writes
    lengths[i] tokens of row i from cache_seqlens[i] on (and moves its ring, as plan/commit_state_rows do);
    every call is logged as (iteration, width of that iterate, [(slot, start, n), ...])."""

    def __init__(self):
        super().__init__()
        self.kv, self.calls, self.gen = {}, [], None

    def update_kv_from_target(self, target_hidden, cache, params, lengths=None):
        assert cache == "dc"
        starts = params["cache_seqlens"].tolist()
        slots = [int(r[0]) for r in params["block_table"]]
        rings = params.get("recurrent_states")
        rows = []
        for i, (slot, start) in enumerate(zip(slots, starts)):
            n = target_hidden[0].shape[1] if lengths is None else lengths[i]
            for k in range(n):
                taps = [tuple(int(v) for v in t[i, k].tolist()) for t in target_hidden]
                assert [tp[2] for tp in taps] == list(range(TAPS)) and len({tp[:2] for tp in taps}) == 1, taps
                assert taps[0][1] == start + k, (taps, start, k)
                self.kv[(slot, start + k)] = taps[0][:2]
            if rings is not None:
                assert rings[i].position >= start, (rings[i].position, start)   # plan_state_rows' window check
                rings[i].position = start + n
            rows.append((slot, start, n))
        g = self.gen
        self.calls.append((g.iterations if g else 0, g.current if g else None, rows))


class KvFakeGenerator(FakeGenerator):
    """FakeGenerator with exllamav3's split: iterate() starts queued jobs (up to max_batch_size, each on a free
    cache slot, its prompt's drafter K/V written as job.prefill does), stashes recurrent checkpoints at page
    boundaries, drafts, then iterate_gen verifies and calls draft_model.update_kv_from_target with the
    accepted lengths after sampling; finished jobs leave afterwards and free their slot. The drafter checks its
    cache (and ring) is current before each draft pass."""

    dflash_draft = True
    draft_recurrent = False
    page = 256

    def __init__(self, *a, max_batch_size=256, **kw):
        super().__init__(*a, max_batch_size=max_batch_size, **kw)
        self.max_batch, self.pending, self.free, self.current, self.stashes = max_batch_size, [], [], None, []
        self.slots, self.exits = 0, []
        self.draft_cache = kw.get("draft_cache")
        if self.draft_model is not None:
            self.draft_model.gen = self

    def enqueue(self, jobs):
        self.pending += jobs

    def num_remaining_jobs(self):
        return len(self.active_jobs) + len(self.pending)

    def clear_queue(self):
        self.free += [j.slot for j in self.active_jobs]
        self.active_jobs, self.pending = [], []

    def slot(self) -> int:
        if self.free:
            return self.free.pop()                        # the slot freed last is reused first
        self.slots += 1
        return self.slots

    def start(self, job) -> None:
        ids = job.sequences[0].sequence_ids.ids
        job.slot, job.kv, job.prefilled = self.slot(), len(ids) - 1, True
        job.ring = FakeRing(0) if self.draft_recurrent else None
        self.active_jobs.append(job)
        if self.draft_model is None:
            return
        params = {"block_table": torch.tensor([[job.slot]]), "cache_seqlens": torch.tensor([0], dtype=torch.int32)}
        if job.ring is not None:
            params["recurrent_states"] = [job.ring]
        self.draft_model.update_kv_from_target(target_hidden=tap_states([(ids[:-1], 0)]), cache=self.draft_cache,
                                               params=params)

    def iterate(self):
        self.iterations += 1
        self.current = "prefill"
        while self.pending and len(self.active_jobs) < self.max_batch:
            self.start(self.pending.pop(0))
        if self.draft_recurrent:
            for job in self.active_jobs:              # exllamav3 stashes the pair (drafter's ring too) here
                if job.kv % self.page == 0:
                    assert job.ring.position == job.kv, f"checkpoint at {job.kv} with the drafter's ring at {job.ring.position}"
                    self.stashes.append((job.slot, job.kv))
        window = self.row_limited(self.num_draft_tokens) if self.draft_model is not None else 0
        self.current = window
        drafted = self.iterate_draftmodel_dflash_gen([], window) if window else None
        self.iterate_gen([], drafted)
        return []

    def iterate_draftmodel_dflash_gen(self, results, window):
        for job in self.active_jobs:
            ids = job.sequences[0].sequence_ids.ids
            stale = [p for p in range(job.kv) if self.draft_model.kv.get((job.slot, p)) != (ids[p], p)]
            assert not stale, f"drafter cache of slot {job.slot} not current at positions {stale[:8]}"
            if job.ring is not None:
                assert job.ring.position == job.kv, f"drafter ring at {job.ring.position}, K/V at {job.kv}"
                job.ring.position += self.block + 1             # the draft pass appends its block to the ring
        return super().iterate_draftmodel_dflash_gen(results, window)

    def iterate_gen(self, results, draft_tokens=None):
        w = draft_tokens.shape[-1] if draft_tokens is not None else 0
        self.widths.append(w)
        if self.clock is not None:
            self.clock.t += self.cost(w, len(self.active_jobs)) / 1000.0
        jobs, lengths, done = list(self.active_jobs), [], []
        rows = [([j.sequences[0].sequence_ids.ids[-1]] + [int(x) for x in (draft_tokens[r, :w] if w else [])], j.kv)
                for r, j in enumerate(jobs)]
        for r, job in enumerate(jobs):
            ids, accepted, n = job.sequences[0].sequence_ids.ids, 0, 0
            for i in range(w + 1):
                t = target_next(ids[-1])
                ids.append(t)
                job.new_tokens, n = job.new_tokens + 1, n + 1
                if t in job.stop or job.new_tokens >= job.max_new_tokens:
                    done.append(job)
                    break
                if i == w or int(draft_tokens[r, i]) != t:
                    break
                accepted += 1
            job.kv += n
            lengths.append(n)
            if w and self.record:
                job.draft_stats.append((job.new_tokens, w, accepted))
        params = {"block_table": torch.tensor([[j.slot] for j in jobs]),
                  "cache_seqlens": torch.tensor([kv for _, kv in rows], dtype=torch.int32)}
        if self.draft_recurrent:
            params["recurrent_states"] = [j.ring for j in jobs]
        if self.draft_model is not None:
            self.draft_model.update_kv_from_target(target_hidden=tap_states(rows), cache=self.draft_cache,
                                                   lengths=lengths, params=params)
        for job in done:                                  # then pages (slots) go back to the pool
            self.active_jobs.remove(job)
            self.free.append(job.slot)
            self.exits.append(self.iterations)


def make_kv_backend(monkeypatch, tmp_path, recurrent: bool = False, **kw):
    """make_backend over KvFakeGenerator with a FakeDrafter (its cache log in be.draft)."""
    monkeypatch.setattr(KvFakeGenerator, "draft_recurrent", recurrent)
    be = make_backend(monkeypatch, tmp_path, **kw)
    be.exl.Generator = KvFakeGenerator
    be.draft = FakeDrafter()
    from toolkit.exl3.hook import recording_generator_class

    be._recording = recording_generator_class(KvFakeGenerator)
    return be
