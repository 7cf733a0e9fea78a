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


def test_measure_runs_fresh_jobs_per_concurrency_and_repetition_on_the_stand_in_generator(monkeypatch, tmp_path):
    from exl3_fakes import make_backend

    from experiments.draft_step import measure
    from experiments.harness import Run

    be = make_backend(monkeypatch, tmp_path)
    be.draft.modules, be.draft.sample_from_state = [], lambda state, params: state
    a = types.SimpleNamespace(concurrency=[1, 4], reps=3, rounds=4, context=64, profile_rounds=4, reserve_s=0.0,
                              levers=["sparse_draft_head=64"])
    seen = []
    be.set_options, set_options = (lambda o: (seen.append(o.tag), set_options(o))), be.set_options
    run = Run("draft_step.json", out=tmp_path)
    out = measure(run, be, a)
    cells = ("c1", "c4", "sparse_draft_head=64/c1", "sparse_draft_head=64/c4")
    assert out["reps_done"] == 3 and set(out) >= set(cells)
    assert all(len(out[k]["step_ms_reps"]) == 3 and out[k]["step_ms"] >= 0 for k in cells)
    assert seen[:4] == ["stock", "sparse_draft_head=64"] * 2 and be.options.tag == "stock"   # interleaved, then reset
    from exl3_fakes import FakeGenerator

    assert all(g.num_remaining_jobs() == 0 for g in FakeGenerator.built)     # every job set was cleared
    assert (tmp_path / "draft_step.json").is_file()


def test_the_step_accounting_skips_the_markers_gpu_range_and_counts_each_step_once():
    from torch.autograd import DeviceType

    from experiments.draft_step import step_accounting

    ev = lambda name, dev, s, t: types.SimpleNamespace(name=name, device_type=dev,
                                                       time_range=types.SimpleNamespace(start=s, end=t))
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [ev("step", cpu, 0, 4000), ev("step", gpu, 100, 3900),          # one step: its CPU range and GPU range
              ev("gemm", gpu, 500, 1500), ev("gemm", gpu, 1200, 2000), ev("argmax", gpu, 3000, 3500),
              ev("step", cpu, 10000, 12000), ev("step", gpu, 10100, 11900),
              ev("gemm", gpu, 10500, 11500), ev("late", gpu, 11800, 12500),   # runs past the step: clipped
              ev("outside", gpu, 20000, 21000)]
    got = step_accounting(events, mark="step")
    assert got["steps"] == 2 and got["step_ms"] == 3.0                      # (4 ms + 2 ms) / 2 steps
    assert got["gpu_busy_ms"] == pytest.approx((2.0 + 1.2) / 2)              # union per step, not the marker's range
    assert got["gpu_idle_ms"] == pytest.approx(3.0 - 1.6)
    assert got["kernel_launches_per_step"] == 2.5 and "step" not in got["kernels_ms_per_step"]
    assert got["kernels_ms_per_step"]["gemm"] == pytest.approx((1.0 + 0.8 + 1.0) / 2)
