"""experiments/switch_cost.py on the CPU: its schedules, one timed schedule on the exllamav3 stand-in
(tests/exl3_fakes.py) and the summary's medians."""

from __future__ import annotations

import pytest
from exl3_fakes import timed_backend

from experiments.switch_cost import CHURN, run_schedule, schedules, summary


def test_schedules_have_the_asked_rounds_and_draw_churn_from_its_set():
    s = schedules(12, seed=3)
    assert set(s) == {"fix7", "fix7full", "fix12full", "fix15", "alt4_12", "churn"}
    assert all(len(w) == 12 for w, _ in s.values())
    assert s["fix7"] == ([7] * 12, False) and s["fix15"][1] is True
    assert s["alt4_12"][0][:4] == [4, 12, 4, 12]
    assert set(s["churn"][0]) <= set(CHURN)
    assert schedules(12, seed=3)["churn"] == s["churn"]             # seeded: the same draw every time


def test_run_schedule_times_every_round_at_its_width(monkeypatch, tmp_path):
    be = timed_backend(monkeypatch, tmp_path, lambda w, rows: 10.0 + 2.0 * w * rows)
    prompts = [be.encode("hello there"), be.encode("another prompt")]
    out = run_schedule(be, prompts, [3, 5, 3], full=True)
    assert [w for w, _, _ in out] == [3, 5, 3]
    for w, ms, got in out:
        assert ms == pytest.approx(10.0 + 2.0 * w * 2)            # the stand-in's cost of w rows per job, 2 jobs
        assert 1.0 <= got <= w + 1


def test_summary_leaves_out_the_settling_rounds():
    reps = [[(3, 100.0, 1.0), (3, 10.0, 2.0), (5, 20.0, 3.0)], [(3, 90.0, 1.0), (3, 12.0, 2.0), (5, 22.0, 3.0)]]
    s = summary(reps, settle=1)
    assert s["ms"] == pytest.approx(16.0) and s["ms_min"] == 10.0
    assert s["per_width"] == {3: {"ms": 11.0, "rounds": 2}, 5: {"ms": 21.0, "rounds": 2}}
    assert s["tokens_per_round"] == 2.5
    assert s["tok_s_per_job"] == [round(5000 / 30, 1), round(5000 / 34, 1)]
    assert summary(reps, settle=3) == {}
