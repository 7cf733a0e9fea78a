"""The timing scripts of experiments/ on stand-ins: the Generator-loop timing (exl3_loop, on a stand-in Generator),
speed's interleaved timing and projection, the pair's targets (pair_mode), draft_step's timing loop, round_trace
and budget's split of a round's kernels."""

from __future__ import annotations

import argparse
import json
import types

import pytest
from exl3_fakes import FakeGenerator, ar_reference, make_backend, timed_backend
from stream_shape import assert_stream_shape

from experiments.exl3_loop import run_jobs
from experiments.harness import Run
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of


# -- the Generator-loop timing (stand-in Generator) ---------------------------------------------------------


@pytest.fixture
def fake_backend(monkeypatch, tmp_path):
    return make_backend(monkeypatch, tmp_path)


PROMPTS = [[1, 2, 3], [4, 9], [20, 21, 22, 23], [30]]


def test_plain_loop_emits_the_ar_tokens(fake_backend):
    loop = run_jobs(fake_backend, PROMPTS, GenSettings(max_new_tokens=40, block_size=6), hooked=False)
    assert loop.tokens == [ar_reference(p, 40) for p in PROMPTS]
    assert loop.rounds == [] and loop.iterations == len(loop.iterate_s) == len(loop.post_s) > 1
    assert loop.seconds >= sum(loop.iterate_s) > 0


def test_hooked_loop_with_rounds_is_generate_many(fake_backend):
    st = GenSettings(max_new_tokens=40, block_size=6)
    loop = run_jobs(fake_backend, PROMPTS, st)
    per_job = {i: [r for j, r in loop.rounds if j == i] for i in range(len(PROMPTS))}
    many = {i: [] for i in range(len(PROMPTS))}
    for i, r in fake_backend.generate_many(PROMPTS, st):
        many[i].append(r)
    for i, p in enumerate(PROMPTS):
        assert tokens_of(per_job[i]) == loop.tokens[i] == ar_reference(p, 40) == tokens_of(many[i])
        assert [r.accepted for r in per_job[i]] == [r.accepted for r in many[i]]
        assert_stream_shape(per_job[i], width=5, max_new_tokens=40)
    assert 0 < loop.overhead_s <= loop.seconds
    hook_only = run_jobs(fake_backend, PROMPTS, st, rounds=False)
    assert hook_only.rounds == [] and hook_only.tokens == loop.tokens


def test_max_steps_stops_early_and_frees_the_jobs(fake_backend):
    loop = run_jobs(fake_backend, PROMPTS, GenSettings(max_new_tokens=40, block_size=6), max_steps=3)
    assert loop.iterations == 3 and len(loop.iterate_s) == 3
    assert fake_backend.engine.gen.num_remaining_jobs() == 0
    assert all(0 < len(t) < 40 for t in loop.tokens)


def test_capture_errors_raise_or_are_recorded(fake_backend, monkeypatch):
    import experiments.exl3_loop as timing

    def broken(*a, **k):
        raise RuntimeError("capture out of step")

    monkeypatch.setattr(timing, "build_round", broken)
    st = GenSettings(max_new_tokens=20, block_size=6)
    with pytest.raises(RuntimeError, match="capture out of step"):
        run_jobs(fake_backend, PROMPTS, st)
    loop = run_jobs(fake_backend, PROMPTS, st, keep_going=True)
    assert loop.capture_error == "capture out of step" and loop.rounds == []
    assert loop.tokens == [ar_reference(p, 20) for p in PROMPTS]


# -- speed: the interleaved timing loop on the stand-in, the projection, the pair's targets ------------------------


def test_speed_shape_interleaves_settings_keeps_partial_results_and_projects(monkeypatch, tmp_path):
    from experiments.speed import projection_rows, time_shape

    # AR (no drafter) costs 8 ms; a speculative round 10 + 2 w c ms, or 10 + w c ms with the lever
    be = timed_backend(monkeypatch, tmp_path, lambda w, rows: 10.0 + 2.0 * w * rows)
    real_generator = be.generator

    def generator(width, hooked=True):
        g = real_generator(width, hooked)
        if g.draft_model is None:
            g.cost = lambda w, rows: 8.0
        elif be.options.graph_draft_swa:
            g.cost = lambda w, rows: 10.0 + 1.0 * w * rows
        return g

    be.generator = generator
    a = argparse.Namespace(concurrency=[1, 4], widths=[0, 1, 3, 7], levers=["graph_draft_swa"], reps=3, passes=1,
                           context=32, reserve_s=0.0, warmup=1)
    run = Run("speed.json", out=tmp_path / "out")
    data = time_shape(run, be, a)
    assert data["ar"] == {1: [pytest.approx(8.0)] * 3, 4: [pytest.approx(8.0)] * 3}
    for c in (1, 4):
        assert data["sets"]["stock"][c][7] == [pytest.approx(10.0 + 14.0 * c)] * 3
        assert data["sets"]["graph_draft_swa"][c][3] == [pytest.approx(10.0 + 3.0 * c)] * 3
    saved = json.loads(run.path.read_text())["timing"]                      # written after every repetition
    assert saved["reps_done"] == 3 and saved["settings"] == ["stock", "graph_draft_swa"]
    assert len(saved["warmup_seconds"]) == 1                                # one untimed pass, not among the 3
    assert saved["round_ms"]["stock"]["4"]["7"]["median"] == pytest.approx(66.0) and be.options.tag == "stock"
    time_shape(run, be, a, "timing_skewed", share=0.5)                      # a second routing keeps the first's
    both = json.loads(run.path.read_text())
    assert both["timing"]["reps_done"] == 3 and both["timing_skewed"]["reps_done"] == 3
    rows = projection_rows(data["ar"], data["sets"], [("x", 3.439, 4)])
    r = next(r for r in rows if r["setting"] == "stock" and r["concurrency"] == 1)
    # w = 0..3 cost 10, 12, 14, 16 ms (w = 2 interpolated); alpha 0.9: (1 + .9 + .81 + .729) / 16 ms is the best
    assert r["policy_width"] == 3 and r["policy_speedup"] == pytest.approx(3.439 / 16 * 8)


def test_speed_shape_with_draft_mtp_synthesises_the_mtp_shape_and_loads_its_head(monkeypatch, tmp_path):
    from pathlib import Path

    import experiments.speed as speed
    from toolkit.exl3.backend import Exl3Backend

    made = []
    monkeypatch.setattr("toolkit.synthetic.synth", lambda cfg, bits, out, **kw: made.append((Path(cfg).name, Path(out).name)))
    speed.synth_pair(tmp_path, False, "random", "mtp")
    assert made == [("qwen3.6-35b-a3b-mtp.json", "target-4.0-mtp")]                 # no DFlash drafter to synthesise
    monkeypatch.setattr(Exl3Backend, "from_dirs", classmethod(lambda cls, t, d, **kw: (t, d)))
    a = argparse.Namespace(work=tmp_path, draft="mtp", widths=list(speed.MTP_WIDTHS), context=32, concurrency=[1, 4])
    assert speed.load_shape(a) == (tmp_path / "target-4.0-mtp", "mtp") and speed.MTP_WIDTHS == (0, 1, 2, 3, 4)


def test_pair_targets_read_the_paired_ratio_and_ignore_lever_cells():
    from experiments.pair_mode import pair_targets

    cells = [{"concurrency": 1, "block_size": "auto", "tok_s": 200.0, "speedup": 2.2, "lossless": 1.0},
             {"concurrency": 1, "block_size": 8, "tok_s": 205.0, "speedup": 2.05, "lossless": 1.0},
             {"concurrency": 8, "block_size": "auto", "tok_s": 900.0, "speedup": 0.9, "lossless": 1.0},
             {"concurrency": 8, "block_size": 8, "tok_s": 1000.0, "speedup": 1.0, "lossless": 1.0},
             {"concurrency": 8, "block_size": 8, "tok_s": 2000.0, "speedup": 2.0, "lossless": 1.0, "lever": "x"}]
    t = pair_targets({"concurrency": [1, 8], "cells": cells})
    assert t["1"] == {"auto_speedup": 2.2, "auto_over_best_fixed": 200 / 205, "lossless": 1.0, "not_slower_than_ar": True,
                      "within_3pct_of_best_fixed": True, "at_least_2x_ar": True}
    assert t["8"]["not_slower_than_ar"] is False and t["8"]["within_3pct_of_best_fixed"] is False   # lever cells do not count
    paired = {"block_size": 8, "ratios": [0.99, 0.97, 1.02], "n": 3, "median": 0.99, "min": 0.97, "max": 1.02}
    cells[2] = {**cells[2], "auto_over_best_fixed": paired}                 # c=8: paired rep by rep, 0.99
    t = pair_targets({"concurrency": [1, 8], "cells": cells})
    assert t["8"]["auto_over_best_fixed"] == 0.99 and t["8"]["within_3pct_of_best_fixed"] is True


# -- draft_step: the drafter step timed per concurrency and setting, interleaved --------------------------------


def test_draft_step_times_fresh_jobs_per_concurrency_and_repetition(monkeypatch, tmp_path):
    from experiments.draft_step import measure

    be = make_backend(monkeypatch, tmp_path)
    be.draft.modules, be.draft.sample_from_state = [], lambda state, params: state
    a = types.SimpleNamespace(concurrency=[1, 4], reps=3, rounds=4, context=64, profile_rounds=4, reserve_s=0.0,
                              levers=["graph_draft_swa"])
    seen = []
    be.set_options, set_options = (lambda o: (seen.append(o.tag), set_options(o))), be.set_options
    out = measure(Run("draft_step.json", out=tmp_path), be, a)
    cells = ("c1", "c4", "graph_draft_swa/c1", "graph_draft_swa/c4")
    assert out["reps_done"] == 3 and set(out) >= set(cells)
    assert all(len(out[k]["step_ms_reps"]) == 3 and out[k]["step_ms"] >= 0 for k in cells)
    assert seen[:4] == ["stock", "graph_draft_swa"] * 2 and be.options.tag == "stock"   # interleaved, then reset
    assert all(g.num_remaining_jobs() == 0 for g in FakeGenerator.built)     # every job set was cleared
    assert (tmp_path / "draft_step.json").is_file()


# -- round_trace: every iterate() a row of its bench cell; the CLI renders a trace file ---------------------------


def test_round_trace_rows_add_up_to_the_decoded_tokens(monkeypatch, tmp_path):
    import toolkit.benchmark.grid as bg
    from exl3_fakes import Clock
    from experiments.round_trace import RoundTrace, summarize

    monkeypatch.setattr(FakeGenerator, "clock", Clock())
    trace = RoundTrace().install()
    try:
        be = make_backend(monkeypatch, tmp_path)
        rounds, _ = bg.run_jobs(be, [[11, 12], [13, 14]], GenSettings(max_new_tokens=40, block_size=8, stop_ids=()), True)
    finally:
        trace.remove()
    mine = [r for r in trace.rows if r["cell"] == "8/c2/n40"]
    assert summarize(trace.rows)["8/c2/n40"]["rounds"] == len(mine) > 0
    assert sum(r["emitted"] for r in mine) == sum(len(r.tokens) for job in rounds for r in job) == 80
    assert {r["w"] for r in mine if r["rows"]} == {7} and [r["t"] for r in trace.rows] == sorted(r["t"] for r in trace.rows)


def test_round_trace_keeps_what_each_auto_choice_saw(monkeypatch, tmp_path):
    import toolkit.benchmark.grid as bg
    from experiments.round_trace import RoundTrace

    be = timed_backend(monkeypatch, tmp_path, lambda w, rows: 10.0 + 0.1 * w * rows)     # drafting pays
    trace = RoundTrace().install()
    try:
        bg.run_jobs(be, [[11, 12], [13, 14]], GenSettings(max_new_tokens=40, block_size="auto", stop_ids=()), True)
    finally:
        trace.remove()
    mine = [r for r in trace.rows if r["cell"] == "auto/c2/n40"]
    assert mine and all(len(r["rates"]) == be.block_size - 1 and r["curve"] for r in mine)
    assert all(r["w"] in {int(w) for w in r["curve"]} | {0} for r in mine)           # a width the curve timed
    assert mine[0]["rates"] == [0.0] * (be.block_size - 1) and max(mine[-1]["rates"]) > 0  # learnt as it went


def test_round_trace_cli_renders_a_trace_and_refuses_other_files(tmp_path, capsys):
    import gzip

    from experiments.round_trace import main, summarize

    rows = [{"cell": "8/c1/n96", "t": 0.0, "w": 7, "rows": 1, "jobs": 1, "ms": 10.0, "emitted": 3},
            {"cell": "8/c1/n96", "t": 0.0105, "w": 7, "rows": 1, "jobs": 1, "ms": 12.0, "emitted": 1},
            {"cell": "auto/c1/n96", "t": 0.03, "w": 3, "rows": 1, "jobs": 1, "ms": 8.0, "emitted": 2}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = summarize(rows)
    assert cells["8/c1/n96"]["gap_ms"] == pytest.approx(0.5) and cells["8/c1/n96"]["tokens_per_ms"] == pytest.approx(4 / 22.5, abs=1e-4)
    assert cells["8/c1/n96"]["one_job"] == {7: {"rounds": 2, "median_ms": 11.0, "tokens_per_round": 2.0}}
    slow = summarize(rows + [dict(rows[0], cell="16/c1/n96", ms=10.0), dict(rows[0], cell="16/c1/n96", ms=16.0)])
    assert slow["16/c1/n96"]["slow"] == 1 and slow["8/c1/n96"]["slow"] == 0     # 16 >= 1.4 x the w=7 median (11)
    assert main([str(trace), "--cells", "auto"]) == 0
    out = capsys.readouterr().out
    assert "| auto/c1/n96 | 1 | 2 | 8 |" in out and "| 0 | w=3: 1 x 8.00 ms" in out and "8/c1/n96" not in out
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    assert main([str(packed), "--cells", "auto"]) == 0 and capsys.readouterr().out == out
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main([str(tmp_path / "bad.jsonl")]) == 2 and main([str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.count("error: ") == 2


# -- budget: each kernel of a round charged to one part ----------------------------------------------------------


def test_round_budget_charges_each_kernel_to_one_part():
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from experiments import budget

    assert budget.charge(["linears", "moe"]) == "moe" and budget.charge(["linears", "attention"]) == "linears"
    assert budget.charge([]) == "other" and budget.charge(["attention", "drafter"]) == "drafter"
    assert budget.busy_us([(0, 10), (5, 12), (20, 25)]) == 17

    def cpu(name, parent=None, kernels=()):
        return NS(name=name, cpu_parent=parent, kernels=[NS(duration=d) for d in kernels], device_type=DeviceType.CPU)

    moe = cpu("budget:moe")
    attn = cpu("budget:attention")
    lin = cpu("budget:linears", attn)
    events = [moe, cpu("launch", moe, [2000]), cpu("launch", cpu("budget:linears", moe), [1000]), attn,
              cpu("launch", lin, [500]), cpu("launch", attn, [300]), cpu("launch", None, [200])]
    events += [NS(name="k", device_type=DeviceType.CUDA, time_range=NS(start=s, end=e), kernels=[]) for s, e in
               ((0, 3000), (3000, 3800), (3800, 4000))]
    out = budget.split(NS(events=lambda: events), rounds=2, wall_ms=2.5)     # no GPU annotations: the CPU links
    assert (out["moe"], out["linears"], out["attention"], out["other"]) == (1.5, 0.25, 0.15, 0.1)
    assert out["gpu_busy"] == 2.0 and out["host_gaps"] == 0.5 and out["charged_share"] == 1.0


def test_round_budget_charges_extension_kernels_by_the_gpu_ranges_around_them():
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from experiments import budget

    def gpu(name, s, e, note=False):
        return NS(name=name, device_type=DeviceType.CUDA, time_range=NS(start=s, end=e), kernels=[],
                  is_user_annotation=note)

    # an attention range holding a projection (linears) and its own kernel, an MoE range holding a linear, a
    # drafter range, and one kernel outside every range; the ranges cover gaps and never count as busy
    events = [gpu("budget:attention", 0, 1000, True), gpu("budget:linears", 0, 400, True), gpu("gemm", 0, 400),
              gpu("attn", 500, 1000), gpu("budget:moe", 1000, 3200, True), gpu("budget:linears", 1000, 1500, True),
              gpu("gemm", 1000, 1500), gpu("mgemm", 1600, 3200), gpu("budget:drafter", 3200, 4200, True),
              gpu("draft", 3300, 4200), gpu("norm", 4200, 4400), gpu("other:timed", 0, 4400, True),
              NS(name="cudaLaunchKernel", device_type=DeviceType.CPU, time_range=NS(start=0, end=1), kernels=[])]
    out = budget.split(NS(events=lambda: events), rounds=2, wall_ms=2.5)
    assert (out["linears"], out["attention"], out["moe"], out["drafter"], out["other"]) == (0.2, 0.25, 1.05, 0.45, 0.1)
    assert out["gpu_busy"] == 2.05 and out["host_gaps"] == 0.45 and out["charged_share"] == 1.0
    assert out["kernels_per_round"] == 3.0


def test_replay_costs_read_the_timed_cells_of_any_answer_length(tmp_path):
    import gzip

    from experiments.policy_replay import costs

    rows = [{"cell": "8/c1/n8", "t": 0.0, "w": 7, "rows": 1, "jobs": 1, "ms": 99.0, "emitted": 3}]     # warm-up wave
    rows += [{"cell": "8/c1/n128", "t": 1.0, "w": 0, "rows": 0, "jobs": 0, "ms": 40.0, "emitted": 0}]  # prefill
    rows += [{"cell": c, "t": 2.0 + i, "w": w, "rows": 1, "jobs": 1, "ms": ms, "emitted": e}
             for i, (c, w, ms, e) in enumerate([("ar/c1/n128", 0, 10.0, 1), ("8/c1/n128", 7, 20.0, 3),
                                                 ("8/c1/n128", 7, 22.0, 5), ("auto/c1/n128", 3, 15.0, 2)])]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"max_new_tokens": 128, "cells": [
        {"block_size": "auto", "costs": {"start": {"1": {"0": 10.0, "3": 14.0, "7": 21.0}}}}]}))
    res = costs(trace, bench, tmp_path / "costs.json.gz")
    assert res["rounds"] == {"1,0": [10.0], "1,3": [15.0], "1,7": [20.0, 22.0]}       # not the 8-token wave's
    assert res["prefill_ms"] == {1: 40.0} and res["per_token_ms"] == pytest.approx(1.0)
    assert json.loads(gzip.decompress((tmp_path / "costs.json.gz").read_bytes()))["start"]["1"]["7"] == 21.0
