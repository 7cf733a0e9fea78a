"""Deferred drafter K/V updates for the AR rounds of exllamav3 1.6.5's speculative Generator (issue 16).

At a draft window of 0, `Generator.iterate()` skips the drafter's forward, but `iterate_gen` still calls
`draft_model.update_kv_from_target(target_hidden=, cache=, lengths=, params=)` after sampling, so the drafter's
context K/V (and the window rings of its sliding layers) follow every token. Only the drafter's next forward
reads them. With the `defer_draft_kv` option on, the recording Generator (exl3_hook) keeps the inputs of those
calls during AR rounds (the target's tap states: one row per job, one token each) and writes a whole stretch
in one call to the same method, with the same row order, block table and start positions. It writes:

- before the drafter runs again (iterate_draftmodel_dflash_gen), and before any update it does not defer
  (a verification round, a hybrid round, anything that is not one token per job);
- when the rows change (a job joined), when a row reaches a page boundary (a completed page can be shared by
  prefix reuse, and exllamav3 stashes recurrent checkpoints, the drafter's window rings included, only there),
  after DEFER_ROUNDS rounds (memory), when a job leaves the Generator (its pages and ring slot go back to the
  pool, not reused before the next iterate) and before clear_queue.

What this relies on in exllamav3 1.6.5, pinned with the round capture (exl3_hook.PINNED_VERSION; the backend
refuses any other version): dflash.dflash_update_kv_from_target writes row i's n tokens at the consecutive
positions cache_seqlens[i] .. + n-1, each K/V row (and ring row, SlidingAttention.plan_state_rows /
write_state_rows) a function of that one position's tap states; AR rounds pass lengths of 1 per row, rows in
the order of the prefilled active jobs; params["cache_seqlens"] and ["block_table"] are that round's host
tables. So one call over n positions is the same work as n calls of one, minus n-1 launches of the projection
and per-layer kernels; its GEMMs run at n rows instead of 1, which may round differently: not yet checked on
a GPU (experiments/speed.py, mode `ar`, compares the Round streams).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .calibrate import PAGE

DEFER_ROUNDS = 64          # AR rounds kept before they are written anyway (bounds the tap states held)


def same(a: Sequence, b: Sequence | None) -> bool:
    """The same objects in the same order (jobs, recurrent states)."""
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


class KvBacklog:
    """The drafter updates skipped by consecutive AR rounds over the same rows, written by `flush`."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or DEFER_ROUNDS
        self.deferred = 0          # AR rounds kept so far (all flushes together)
        self.flushes = 0           # batched writes made
        self._reset()

    def _reset(self) -> None:
        self.update: Callable | None = None
        self.jobs: list = []
        self.states: list[torch.Tensor] = []     # per round: the tap states concatenated, [rows, 1, sum(widths)]
        self.widths: list[int] = []
        self.start = self.block_table = self.cache = self.recurrent = None
        self.positions: list[int] = []

    @property
    def rounds(self) -> int:
        return len(self.states)

    def add(self, update: Callable, jobs: list, target_hidden: list, cache, params: dict) -> None:
        """Keep one AR round's update; write the backlog at once when a rule in the module docstring says so."""
        recurrent = params.get("recurrent_states")
        if self.states and not (self.update == update and same(jobs, self.jobs) and cache is self.cache
                                and (recurrent is None) == (self.recurrent is None)
                                and (recurrent is None or same(recurrent, self.recurrent))):
            self.flush()
        if not self.states:
            self.update, self.jobs, self.cache, self.recurrent = update, list(jobs), cache, recurrent
            self.widths = [t.shape[-1] for t in target_hidden]
            self.start = params["cache_seqlens"].clone()              # first deferred position per row
            self.positions = [int(p) for p in self.start.reshape(-1).tolist()]
        dev = target_hidden[0].device
        self.states.append(torch.cat([t.to(dev) for t in target_hidden], dim=-1))   # a copy: no aliasing
        self.block_table = params["block_table"].clone()              # the latest covers every position so far
        self.deferred += 1
        n = len(self.states)
        if n >= self.limit or any((p + n) % PAGE == 0 for p in self.positions):
            self.flush()

    def flush(self) -> None:
        """Write every kept round in one update_kv_from_target call (nothing when empty)."""
        if not self.states:
            return
        update, cache, n, rows = self.update, self.cache, len(self.states), len(self.jobs)
        hidden = list(torch.split(torch.cat(self.states, dim=1), self.widths, dim=-1))
        params = {"block_table": self.block_table, "cache_seqlens": self.start}
        if self.recurrent is not None:
            params["recurrent_states"] = self.recurrent
        self._reset()
        self.flushes += 1
        update(target_hidden=hidden, cache=cache, lengths=[n] * rows, params=params)

    def drop(self) -> None:
        """Forget the kept rounds (the Generator is retired)."""
        self._reset()


def can_defer(gen) -> bool:
    """Whether this Generator's drafter is updated through update_kv_from_target (a DFlash-family drafter)."""
    model = getattr(gen, "draft_model", None)
    return bool(getattr(gen, "dflash_draft", False)) and callable(getattr(model, "update_kv_from_target", None))


def one_token_per_job(jobs: list, target_hidden, lengths) -> bool:
    """An AR round's update: one single-sequence row per prefilled job, one token each."""
    if not target_hidden or lengths is None or len(lengths) != len(jobs) or any(n != 1 for n in lengths):
        return False
    if any(len(j.sequences) != 1 for j in jobs):
        return False
    return all(t.dim() == 3 and t.shape[0] == len(jobs) and t.shape[1] == 1 for t in target_hidden)


def deferred_iterate_gen(gen, inner: Callable, results: list, draft_tokens) -> None:
    """Run `inner` (exllamav3's iterate_gen) with an AR round's drafter update kept in gen.kv_backlog."""
    backlog: KvBacklog = gen.kv_backlog
    if draft_tokens is not None or not can_defer(gen):
        backlog.flush()                      # the drafter update of a verified round lands after what was kept
        return inner(results, draft_tokens)
    model = gen.draft_model
    real = model.update_kv_from_target
    had = "update_kv_from_target" in vars(model)

    def update(target_hidden, cache, params, lengths=None):
        jobs = [j for j in gen.active_jobs if j.is_prefill_done()]
        if one_token_per_job(jobs, target_hidden, lengths):
            backlog.add(real, jobs, target_hidden, cache, params)
        else:
            backlog.flush()
            real(target_hidden=target_hidden, cache=cache, params=params, lengths=lengths)

    model.update_kv_from_target = update     # an instance attribute for this call only
    try:
        inner(results, draft_tokens)
    finally:
        if had:
            model.update_kv_from_target = real
        else:
            del model.update_kv_from_target
    if backlog.jobs and not all(any(j is a for a in gen.active_jobs) for j in backlog.jobs):
        backlog.flush()                      # a job left: write its rows before its pages can be reused
