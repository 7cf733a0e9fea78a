"""experiments/draft_step.py on the CPU: its per-part timer around a stand-in drafter and the summary's medians."""

from __future__ import annotations

import types

import pytest

from experiments.draft_step import PartTimer, summarize


class Module:
    def __init__(self, log):
        self.log = log

    def forward(self, x, params):
        self.log.append("forward")
        return x + 1


def test_the_part_timer_times_each_module_only_while_on_and_syncs_only_when_synced():
    log, syncs = [], []
    draft = types.SimpleNamespace(modules=[Module(log), Module(log)], sample_from_state=lambda state, params: state * 2)
    timer = PartTimer(types.SimpleNamespace(draft=draft))
    timer.sync = lambda: syncs.append(1)
    run = lambda: draft.sample_from_state(draft.modules[1].forward(draft.modules[0].forward(1, {}), {}), {})
    assert run() == 6 and timer.take() == {} and not syncs              # off: the calls pass straight through
    timer.mode = "synced"
    run()
    assert len(syncs) == 6 and log == ["forward"] * 4
    timer.mode = "host"
    run()
    assert len(syncs) == 6                                                # host: no synchronize
    got = timer.take()
    assert set(got) == {"0:Module", "1:Module", "head:sample_from_state"} and all(v >= 0 for v in got.values())
    assert timer.take() == {}                                             # take() starts afresh


def test_the_summary_takes_medians_over_repetitions_and_sums_the_parts():
    cell = {"step": [5.0, 4.0, 6.0],
            "synced": [{"a": 1.0, "head": 2.0}, {"a": 3.0, "head": 2.0}, {"a": 2.0, "head": 4.0}],
            "host": [{"a": 0.5, "head": 0.25}, {"a": 0.5, "head": 0.75}, {"a": 1.5, "head": 0.5}]}
    s = summarize(cell)
    assert s["step_ms"] == 5.0 and s["step_ms_reps"] == [5.0, 4.0, 6.0]
    assert s["parts"] == {"a": {"synced_ms": 2.0, "host_ms": 0.5}, "head": {"synced_ms": 2.0, "host_ms": 0.5}}
    assert s["synced_sum_ms"] == pytest.approx(4.0) and s["host_sum_ms"] == pytest.approx(1.0)
