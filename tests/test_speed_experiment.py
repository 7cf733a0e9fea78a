"""experiments/speed.py on the CPU: the GPU-busy interval union, the interleaved timing loop on the exllamav3
stand-in (tests/exl3_fakes.py), the projection and the issue's targets from its results."""

from __future__ import annotations

import argparse
import json

import pytest
from exl3_fakes import Clock, FakeGenerator, timed_backend

from experiments.harness import Run
from experiments.pair_mode import pair_targets
from experiments.speed import (
    ar_overhead,
    busy,
    projection_rows,
    shape_targets,
    time_shape,
)


def test_busy_is_the_union_of_intervals():
    assert busy([]) == 0.0
    assert busy([(0, 2), (1, 3), (5, 6)]) == 4.0            # overlapping kernels count once
    assert busy([(5, 6), (0, 10), (2, 3)]) == 10.0
    assert busy([(0, 1), (1, 2)]) == 2.0


@pytest.fixture
def shape_run(monkeypatch, tmp_path):
    # AR (no drafter) costs 8 ms; a speculative round 10 + 2 w c ms, or 10 + w c ms with the lever below
    be = timed_backend(monkeypatch, tmp_path, lambda w, rows: 10.0 + 2.0 * w * rows)
    real_generator = be.generator

    def generator(width, hooked=True):
        g = real_generator(width, hooked)
        if g.draft_model is None:
            g.cost = lambda w, rows: 8.0
        elif be.options.sparse_draft_head:
            g.cost = lambda w, rows: 10.0 + 1.0 * w * rows
        return g

    be.generator = generator
    a = argparse.Namespace(concurrency=[1, 4], widths=[0, 1, 3, 7], levers=["sparse_draft_head=64"], reps=3, passes=1,
                           context=32, reserve_s=0.0, warmup=1)
    run = Run("speed.json", out=tmp_path / "out")
    return run, time_shape(run, be, a), be


def test_timing_interleaves_settings_and_keeps_partial_results(shape_run):
    run, data, be = shape_run
    assert data["ar"] == {1: [pytest.approx(8.0)] * 3, 4: [pytest.approx(8.0)] * 3}
    assert set(data["sets"]) == {"stock", "sparse_draft_head=64"}
    for c in (1, 4):
        assert data["sets"]["stock"][c][7] == [pytest.approx(10.0 + 14.0 * c)] * 3
        assert data["sets"]["sparse_draft_head=64"][c][3] == [pytest.approx(10.0 + 3.0 * c)] * 3
    saved = json.loads(run.path.read_text())["timing"]                      # written after every repetition
    assert saved["reps_done"] == 3 and saved["settings"] == ["stock", "sparse_draft_head=64"]
    assert len(saved["warmup_seconds"]) == 1                                # one untimed pass, not among the 3
    assert saved["round_ms"]["stock"]["4"]["7"]["median"] == pytest.approx(66.0) and saved["ar_ms"]["1"]["n"] == 3
    assert be.options.tag == "stock"


def test_projection_and_targets_from_the_timing(shape_run):
    _, data, _ = shape_run
    rows = projection_rows(data["ar"], data["sets"], [("x", 3.439, 4), ("DF-8", 5.74, 8)])
    assert {(r["setting"], r["concurrency"], r["name"]) for r in rows} == {
        (s, c, n) for s in ("stock", "sparse_draft_head=64") for c in (1, 4) for n in ("x", "DF-8")}
    assert not projection_rows(data["ar"], data["sets"], [("DF-16", 7.63, 16)])         # w = 15 was not measured
    r = next(r for r in rows if r["setting"] == "stock" and r["concurrency"] == 1)
    # w = 0..3 cost 10, 12, 14, 16 ms (w = 2 interpolated); alpha 0.9: (1 + .9 + .81 + .729) / 16 ms is the best
    assert r["policy_width"] == 3 and r["policy_speedup"] == pytest.approx(3.439 / 16 * 8)
    assert shape_targets(rows) == {}                                                    # DF-16 not in these rows
    assert ar_overhead(data["ar"], data["sets"]["stock"]) == {"1": pytest.approx(10 / 8), "4": pytest.approx(10 / 8)}
    df16 = [{"setting": "stock", "concurrency": 1, "name": "DF-16", "default_speedup": 1.6, "policy_speedup": 2.4,
             "policy_width": 7}]
    assert shape_targets(df16)["pass"] is True and shape_targets([{**df16[0], "policy_speedup": 2.0}])["pass"] is False
    adopted = {**df16[0], "setting": "graph_draft_swa", "policy_speedup": 2.3, "default_speedup": 1.9}
    t = shape_targets([{**df16[0], "policy_speedup": 2.0}, adopted])        # the defaults' policy against stock defaults
    assert t["setting"] == "graph_draft_swa" and t["policy_over_defaults"] == pytest.approx(2.3 / 1.6) and t["pass"]


def test_pair_targets():
    cells = [{"concurrency": 1, "block_size": "auto", "tok_s": 200.0, "speedup": 2.2, "lossless": 1.0},
             {"concurrency": 1, "block_size": 16, "tok_s": 180.0, "speedup": 1.8, "lossless": 1.0},
             {"concurrency": 1, "block_size": 8, "tok_s": 205.0, "speedup": 2.05, "lossless": 1.0},
             {"concurrency": 8, "block_size": "auto", "tok_s": 900.0, "speedup": 0.9, "lossless": 1.0},
             {"concurrency": 8, "block_size": 8, "tok_s": 1000.0, "speedup": 1.0, "lossless": 1.0},
             {"concurrency": 8, "block_size": 8, "tok_s": 2000.0, "speedup": 2.0, "lossless": 1.0, "lever": "x"}]
    t = pair_targets({"concurrency": [1, 8], "cells": cells})
    assert t["1"] == {"auto_speedup": 2.2, "auto_over_best_fixed": 200 / 205, "lossless": 1.0, "not_slower_than_ar": True,
                      "within_3pct_of_best_fixed": True, "at_least_2x_ar": True}
    assert t["8"]["not_slower_than_ar"] is False and t["8"]["within_3pct_of_best_fixed"] is False   # lever cells do not count
    assert "at_least_2x_ar" not in t["8"]
    paired = {"block_size": 8, "ratios": [0.99, 0.97, 1.02], "n": 3, "median": 0.99, "min": 0.97, "max": 1.02}
    cells[3] = {**cells[3], "auto_over_best_fixed": paired}                 # c=8: paired rep by rep, 0.99
    t = pair_targets({"concurrency": [1, 8], "cells": cells})
    assert t["8"]["auto_over_best_fixed"] == 0.99 and t["8"]["within_3pct_of_best_fixed"] is True
    assert t["8"]["paired"] == {**{k: paired[k] for k in ("block_size", "median", "min", "max", "n")},
                                "first": 0.99, "later_median": 0.995} and "paired" not in t["1"]
    cells[0] = {**cells[0], "costs": {"start": {}, "new_shape_excess_ms": 41.5, "plain_ar_requests": 3}}
    assert pair_targets({"concurrency": [1], "cells": cells})["1"]["new_shape_excess_ms"] == 41.5
    assert pair_targets({"concurrency": [1], "cells": cells})["1"]["plain_ar_requests"] == 3
    cells[3]["auto_over_best_fixed"] = {**paired, "median": 0.96}
    assert pair_targets({"concurrency": [8], "cells": cells})["8"]["within_3pct_of_best_fixed"] is False


# -- mode ar (experiments/ar_rounds.py): the policy's AR rounds, exllamav3's per-token update vs defer_draft_kv --


def test_ar_mode_times_ar_today_and_cut_and_checks_the_output(monkeypatch, tmp_path):
    """Stand-in costs: a round 8 + 2 w c ms, every drafter update call 2 ms more (whatever its length)."""
    from exl3_kv_fakes import FakeDrafter, make_kv_backend

    from experiments.ar_rounds import greedy_check, time_variants

    clock = Clock()
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(lambda w, rows: 8.0 + 2.0 * w * rows))
    real = FakeDrafter.update_kv_from_target

    def costly(self, *a, **k):
        clock.t += 0.002
        return real(self, *a, **k)

    monkeypatch.setattr(FakeDrafter, "update_kv_from_target", costly)
    be = make_kv_backend(monkeypatch, tmp_path)
    be.clock = clock
    a = argparse.Namespace(concurrency=[1, 2], reps=3, passes=1, stretch=4, draft_width=3, context=32, reserve_s=0.0, warmup=1,
                           check_concurrency=[1, 2], check_tokens=20)
    run = Run("speed.json", out=tmp_path / "out")
    samples = time_variants(run, be, a)
    for c in (1, 2):
        s = samples[c]
        assert s["ar"] == [pytest.approx(8.0)] * 3
        assert s["today_w0_mean"] == [pytest.approx(10.0)] * 3                            # the update in every AR round
        assert s["today_w0_median"] == [pytest.approx(10.0)] * 3
        assert s["cut_w0_mean"] == [pytest.approx(8.0)] * 3                               # deferred: an AR step
        assert s["today_draft_median"] == [pytest.approx(10.0 + 6.0 * c)] * 3
        assert s["cut_draft_median"] == [pytest.approx(12.0 + 6.0 * c)] * 3              # + the one catch-up call
        assert s["cut_stretch_mean"] == [pytest.approx((32.0 + 12.0 + 6.0 * c) / 5)] * 3
    cells = json.loads((tmp_path / "out" / "speed.json").read_text())["ar_rounds"]["cells"]
    assert cells["1"]["today_w0_over_ar"] == pytest.approx(1.25) and cells["1"]["cut_w0_over_ar"] == pytest.approx(1.0)
    assert cells["2"]["catch_up_ms"] == pytest.approx(2.0) and cells["2"]["cut_within_5pct_of_ar"] is True
    assert cells["1"]["spread"]["ar"]["n"] == 3
    check = greedy_check(be, a)
    assert set(check) == {"1", "2"}
    for row in check.values():
        assert row["today_equals_ar"] and row["cut_equals_ar"] and row["cut_equals_today"]
        assert row["rounds_differing"] == 0 and row["rounds"] > 0
    assert be.draft.calls and be.options.defer_draft_kv is False


def test_speed_ar_warms_up_untimed_then_keeps_only_the_repetitions(monkeypatch, tmp_path):
    import types

    import toolkit.exl3.calibrate as cal
    from experiments.ar_rounds import time_variants
    from experiments.harness import Run

    calls = []

    def fake_time_rounds(be, c, widths, reps=1, context=0, speculative=True, **kw):
        calls.append((c, speculative))
        first = len(calls) <= 3                          # the warm-up pass: cold and slow
        ms = 100.0 if first else 10.0
        return {0: [ms] * reps} if not speculative else {w: [ms + w] for w in set(widths)}

    monkeypatch.setattr(cal, "time_rounds", fake_time_rounds)
    be = types.SimpleNamespace(set_options=lambda o: None)
    a = types.SimpleNamespace(stretch=4, draft_width=7, concurrency=[1], reps=3, reserve_s=0.0, passes=1, context=64, warmup=1)
    run = Run("speed.json", out=tmp_path)
    samples = time_variants(run, be, a)
    assert len(calls) == 3 * 4                           # one warm-up pass, three repetitions, 3 timings each
    assert samples[1]["ar"] == [10.0, 10.0, 10.0] and len(run.results["ar_rounds"]["warmup_seconds"]) == 1
    assert run.results["ar_rounds"]["reps_done"] == 3


def test_host_profile_interleaves_the_three_variants_and_reports_medians(monkeypatch, tmp_path):
    import types

    import experiments.speed as speed
    from exl3_fakes import make_backend

    be = make_backend(monkeypatch, tmp_path)
    started = []
    real_start = speed.start_variant
    monkeypatch.setattr(speed, "start_variant", lambda be, name, *a: (started.append(name), real_start(be, name, *a))[1])
    monkeypatch.setattr(speed, "profile_rounds", lambda step, n: {"wall_ms": 9.0, "gpu_busy_ms": 5.0, "gpu_idle_ms": 4.0})
    out = speed.profile_host(be, types.SimpleNamespace(profile_rounds=3, profile_reps=3, context=16))
    assert started == ["exllamav3", "recording", "policy", "recording", "policy", "exllamav3", "policy", "exllamav3", "recording"]
    for v in speed.VARIANTS:
        assert len(out[v]["wall_ms_reps"]) == 3 and out[v]["wall_ms_reps"][-1] == 9.0     # the profiled window last
        assert out[v]["wall_ms"] == sorted(out[v]["wall_ms_reps"])[1]
    assert out["added_by_capture_ms"] == 0.0 and "added_wall_by_policy_path_ms" in out
