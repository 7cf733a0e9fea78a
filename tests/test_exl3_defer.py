"""defer_draft_kv on the CPU (toolkit/runtime/exl3_defer.py): AR rounds of the speculative Generator keep the
drafter's K/V update and write a whole AR stretch in one call before the drafter runs again. Against the stand-in
of exllamav3 1.6.5's iterate / iterate_gen / update_kv_from_target split (tests/exl3_kv_fakes.py), whose drafter
refuses to draft from a cache (or ring) that is not current."""

from __future__ import annotations

import types

import pytest
import torch
from exl3_fakes import Clock, FakeGenerator, FakeJob, ar_reference
from exl3_kv_fakes import FakeDrafter, KvFakeGenerator, make_kv_backend
from test_exl3_backend import endless_prompts

from toolkit.core.errors import ToolkitError
from toolkit.exl3 import defer as exl3_defer
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of
from toolkit.exl3.hook import recording_generator_class
from toolkit.exl3.options import Exl3Options, parse_lever


def recording(monkeypatch, defer: bool, recurrent: bool = False, max_batch: int = 8):
    monkeypatch.setattr(KvFakeGenerator, "draft_recurrent", recurrent)
    cls = recording_generator_class(KvFakeGenerator)
    g = cls(None, types.SimpleNamespace(), None, max_batch_size=max_batch, draft_model=FakeDrafter(),
            draft_cache="dc", num_draft_tokens=7, record_draft_stats=True)
    g.set_defer(defer)
    return g


def job(prompt: list[int], max_new: int, stop=()) -> FakeJob:
    return FakeJob(torch.tensor([prompt]), max_new, "argmax", 0, list(stop), 0)


def drive(g, jobs: list, widths: list[int]) -> list[list[int]]:
    """iterate() until every job is done, verifying widths[k] in iterate k+1 (0 after the list); the ids."""
    g.enqueue(jobs)
    k = 0
    while g.num_remaining_jobs():
        g.set_width(widths[k] if k < len(widths) else 0, 7)
        g.iterate()
        k += 1
    return [j.sequences[0].sequence_ids.ids for j in jobs]


def gen_calls(g) -> list:
    return [c for c in g.draft_model.calls if c[1] != "prefill"]


def test_an_ar_stretch_is_written_in_one_call_before_the_drafter_runs(monkeypatch):
    widths = [0, 0, 0, 0, 0, 3, 0, 0, 7, 0]
    off, on = recording(monkeypatch, False), recording(monkeypatch, True)
    ids_off = drive(off, [job([11, 12, 13], 14)], widths)
    ids_on = drive(on, [job([11, 12, 13], 14)], widths)
    assert ids_off == ids_on and ids_off[0][3:] == ar_reference([11, 12, 13], 14, stop=())
    slot = 1
    today = gen_calls(off)
    assert [(i, w) for i, w, _ in today] == [(k + 1, widths[k]) for k in range(len(today))]   # one call per iterate
    assert all(rows == [(slot, 2 + k, 1)] for k, (_, w, rows) in enumerate(today[:5]))      # per token in AR rounds
    n6, n9 = today[5][2][0][2], today[8][2][0][2]           # tokens the two verified rounds emitted
    p6 = 7
    assert gen_calls(on) == [
        (6, 3, [(slot, 2, 5)]),                  # the 5 AR tokens at positions 2..6, then the drafter ran
        (6, 3, [(slot, p6, n6)]),                # the verified round's own update, as today
        (9, 7, [(slot, p6 + n6, 2)]),            # the next 2 AR tokens, before the next draft pass
        (9, 7, [(slot, p6 + n6 + 2, n9)]),
        (10, 0, [(slot, p6 + n6 + 2 + n9, 1)]),  # the job ended in an AR round: written as it leaves
    ]
    assert on.draft_model.kv == off.draft_model.kv and on.kv_backlog.deferred == 8 and on.kv_backlog.flushes == 3


def test_round_stream_is_unchanged_under_auto_with_many_ar_rounds(monkeypatch, tmp_path):
    """c=8 on the timed stand-in (a round costs 10 + 2 w c ms): the policy mostly decodes AR and probes."""
    monkeypatch.setattr(FakeGenerator, "good", staticmethod(lambda last, block: 3))
    prompts = endless_prompts(8, 60)
    streams = {}
    for defer in (False, True):
        clock = Clock()
        monkeypatch.setattr(FakeGenerator, "clock", clock)
        be = make_kv_backend(monkeypatch, tmp_path / str(defer))
        be.clock = clock
        be.set_options(Exl3Options(defer_draft_kv=defer))
        per_job = {i: [] for i in range(8)}
        for i, r in be.generate_many(prompts, GenSettings(max_new_tokens=60)):
            per_job[i].append(r)
        g = be._gen
        ar_iters = {k + 1 for k, w in enumerate(g.widths) if w == 0}
        ar_calls = [c for c in be.draft.calls if c[0] in ar_iters and c[1] == 0]
        streams[defer] = (per_job, ar_iters, ar_calls, g, be.draft.kv)
    (off, ar_off, calls_off, g_off, kv_off), (on, ar_on, calls_on, g_on, kv_on) = streams[False], streams[True]
    for i, p in enumerate(prompts):
        assert tokens_of(on[i]) == tokens_of(off[i]) == ar_reference(p, 60)
        key = lambda r: (r.drafted, r.accepted, r.bonus, r.prefill, r.proposed, round(r.t_draft_ms + r.t_verify_ms, 6))
        assert [key(r) for r in on[i]] == [key(r) for r in off[i]]      # drafted, accepted, bonus, timing per round
    assert ar_on == ar_off and len(ar_on) > 30 and g_on.widths == g_off.widths
    assert len(calls_off) == len(ar_off)                    # today: the drafter's update in every AR round
    exits = set(g_on.exits)
    page_ends = lambda rows: any((start + n) % 256 == 0 for _, start, n in rows)
    assert all(i in exits or page_ends(rows) for i, _, rows in calls_on)   # AR rounds write only as a job
    assert len(calls_on) < len(ar_on) / 4 and kv_on == kv_off                # leaves or a page completes


def test_a_finished_job_is_written_before_its_slot_is_reused(monkeypatch):
    """One slot, two jobs: A ends inside an AR stretch; B takes A's slot, prefills and drafts over it."""
    widths = [0] * 6 + [0, 0, 3, 0, 5]
    runs = []
    for defer in (False, True):
        g = recording(monkeypatch, defer, max_batch=1)
        ids = drive(g, [job([20, 21], 6), job(list(range(30, 40)), 12)], widths)
        runs.append((g, ids))
    (off, ids_off), (on, ids_on) = runs
    assert ids_on == ids_off
    calls = on.draft_model.calls
    assert (6, 0, [(1, 1, 6)]) in calls                     # A's six AR tokens, written in the iterate A ended
    assert calls.index((6, 0, [(1, 1, 6)])) < calls.index((7, "prefill", [(1, 0, 9)]))   # before B's prefill
    assert on.draft_model.kv == off.draft_model.kv


def test_sliding_window_rings_are_current_at_every_page_boundary(monkeypatch):
    """A recurrent drafter: exllamav3 stashes its ring with the target's checkpoints at page boundaries."""
    monkeypatch.setattr(exl3_defer, "PAGE", 16)
    monkeypatch.setattr(KvFakeGenerator, "page", 16)
    widths = [0] * 30 + [3]
    off, on = recording(monkeypatch, False, recurrent=True), recording(monkeypatch, True, recurrent=True)
    assert drive(off, [job([9, 8, 7, 6, 10], 40)], widths) == drive(on, [job([9, 8, 7, 6, 10], 40)], widths)
    assert on.stashes == off.stashes and [kv for _, kv in on.stashes] == [16, 32]
    first = gen_calls(on)[:2]
    assert first == [(12, 0, [(1, 4, 12)]), (28, 0, [(1, 16, 16)])]   # written as each page completes
    assert on.draft_model.kv == off.draft_model.kv


def test_a_long_stretch_is_written_every_defer_rounds(monkeypatch):
    monkeypatch.setattr(exl3_defer, "DEFER_ROUNDS", 4)
    on = recording(monkeypatch, True)
    drive(on, [job([11, 12, 13], 12)], [0] * 10 + [3])
    assert [c for c in gen_calls(on) if c[1] == 0] == [(4, 0, [(1, 2, 4)]), (8, 0, [(1, 6, 4)])]
    assert gen_calls(on)[2] == (11, 3, [(1, 10, 2)])       # the rest before the drafter's pass


def test_the_option_is_a_lever_off_by_default(monkeypatch, tmp_path):
    assert Exl3Options().defer_draft_kv is False and Exl3Options().tag == "stock"
    label, opts = parse_lever("defer-draft-kv")
    assert label == "defer_draft_kv" and opts == Exl3Options(defer_draft_kv=True) and opts.tag == "defer_draft_kv"
    assert opts.generator_kwargs() == {}                   # ours: not an exllamav3 argument
    with pytest.raises(ToolkitError, match="bad value"):
        parse_lever("defer_draft_kv=2")
    be = make_kv_backend(monkeypatch, tmp_path)
    assert be.generator(7).kv_backlog is None              # today's path unless asked
    be.set_options(opts)
    assert be.generator(7).kv_backlog is not None and be.generator(0, hooked=False).draft_model is None


def test_defer_is_pinned_to_the_generator_it_was_written_against():
    g = recording_generator_class(FakeGenerator)(None, types.SimpleNamespace(), None, draft_model=FakeDrafter())
    g.set_defer(False)
    with pytest.raises(ToolkitError, match=r"no iterate_gen\(\): this exllamav3 is not 1\.6\.5"):
        g.set_defer(True)
