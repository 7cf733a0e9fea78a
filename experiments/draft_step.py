"""Where the DFlash drafter's step goes on exllamav3: on the real shape a 0.39B model at a fixed 16-row shape, run
every round, costs a large share of an AR step of the 35B target.

On the synthetic Qwen3.6-35B-A3B pair of experiments/speed.py (target 4.0 bpw, drafter 6.0 bpw in /tmp/speed,
synthesised when absent), steady dummy jobs verify w = 7 (the drafter runs its whole block whatever w is) at each
c, and the same rounds are timed three ways, interleaved over repetitions:

1. `step`: the hook's t_draft_ms, all of iterate_draftmodel_dflash_gen (staging, the drafter's forward, the
   target's head and argmax, the copy to the host);
2. `synced`: ms of every part of the step with a device synchronize around it (each of the drafter's modules,
   and sample_from_state: the target's head and argmax), what each part costs on a drained GPU; `host`: the
   same parts without the synchronize, what launching them costs the host;
3. `profile`: torch.profiler over the rounds: GPU-busy and GPU-idle ms inside the drafter step, and the CUDA
   kernels that ran in it, by total ms.

If `host` adds up to about `step` and the GPU idles for most of the step, the step is host-bound: a captured
(CUDA-graphed) drafter forward or fewer launches would cut it; if `synced` adds up to `step`, the kernels are.

    source .device/on-device.sh && timeout 300 python -m experiments.draft_step               (carry [".device"])

Writes $OUT/draft_step.json after every step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from experiments.harness import Repetitions, Run, device_name, env_float

WIDTH = 7


class PartTimer:
    """Wraps the drafter's modules and sample_from_state; while `mode` is "synced" or "host", every call is timed
    into `ms[part]` (synced: a device synchronize before and after the call)."""

    def __init__(self, be):
        import torch

        self.sync, self.mode = torch.cuda.synchronize, None
        self.ms: dict[str, list[float]] = defaultdict(list)
        for i, m in enumerate(be.draft.modules):
            m.forward = self.wrap(f"{i}:{type(m).__name__}", m.forward)
        be.draft.sample_from_state = self.wrap("head:sample_from_state", be.draft.sample_from_state)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            if self.mode is None:
                return fn(*a, **k)
            if self.mode == "synced":
                self.sync()
            t0 = time.perf_counter()
            y = fn(*a, **k)
            if self.mode == "synced":
                self.sync()
            self.ms[name].append((time.perf_counter() - t0) * 1000.0)
            return y
        return timed

    def take(self) -> dict[str, float]:
        """Median ms per part over the calls since the last take()."""
        out = {k: round(statistics.median(v), 3) for k, v in self.ms.items() if v}
        self.ms.clear()
        return out


def start_jobs(be, c: int, context: int, max_new: int):
    """c dummy jobs on the hooked Generator at verify width WIDTH (the drafter's whole block kept), prefilled."""
    from toolkit.runtime.backend import GenSettings
    from toolkit.exl3.calibrate import dummy_prompts

    gen = be.generator(be.block_size - 1)
    prompts = dummy_prompts(c, context, be.vocab_size)
    gen.enqueue(be._jobs(prompts, GenSettings(max_new_tokens=max_new, block_size=None, stop_ids=())))
    gen.set_width(WIDTH, be.block_size - 1)
    for _ in range(8 + c):                       # prefill, then the shape's eager run, capture and first replay
        gen.iterate()
    return gen


def draft_window(gen, rounds: int) -> list[float]:
    """t_draft_ms of `rounds` iterates."""
    out = []
    for _ in range(rounds):
        gen.iterate()
        out.append(gen.t_draft_ms)
    return out


def profile_draft(gen, rounds: int) -> dict:
    """GPU busy/idle ms per drafter step and its kernels, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    inner = gen.iterate_draftmodel_dflash_gen

    def marked(*a, **k):
        with record_function("dflash_draft_step"):
            return inner(*a, **k)

    gen.iterate_draftmodel_dflash_gen = marked
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds):
                gen.iterate()
    finally:
        del gen.iterate_draftmodel_dflash_gen
    return step_accounting(prof.events())


def step_accounting(events, mark: str = "dflash_draft_step") -> dict:
    """Per step marked `mark`: wall, GPU-busy and GPU-idle ms, kernel launches and the kernels by total ms.
    record_function also leaves a GPU-side range named `mark`: the steps are its CPU ranges and the kernels
    exclude it (else it counts as one long kernel and every step twice)."""
    from torch.autograd import DeviceType

    from experiments.budget import busy_us as busy

    steps = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == mark and e.device_type == DeviceType.CPU)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.name != mark]
    gpu, launches, per_kernel = 0.0, 0, defaultdict(float)
    for s, t in steps:                            # kernel spans clipped to the step; kernels that started in it
        gpu += busy([(max(e.time_range.start, s), min(e.time_range.end, t)) for e in kernels
                     if e.time_range.end > s and e.time_range.start < t])
        started = [e for e in kernels if s <= e.time_range.start < t]
        launches += len(started)
        for e in started:
            per_kernel[e.name] += (e.time_range.end - e.time_range.start) / 1000.0
    n = max(len(steps), 1)
    wall, gpu = sum(t - s for s, t in steps) / 1000.0, gpu / 1000.0
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {"steps": len(steps), "step_ms": round(wall / n, 3), "gpu_busy_ms": round(gpu / n, 3),
            "gpu_idle_ms": round((wall - gpu) / n, 3), "kernels_ms_per_step": {k: round(v / n, 4) for k, v in top},
            "kernel_launches_per_step": round(launches / n, 1)}


def measure(run: Run, be, a) -> dict:
    """The interleaved repetitions (each setting and c on fresh jobs: the backend has one Generator), then the
    profiles. Stock settings are keyed c1, c4, ...; a lever's cells "<lever>/c1", ..."""
    from toolkit.exl3.options import Exl3Options, parse_lever

    timer = PartTimer(be)
    out = run.results.setdefault("draft_step", {})
    sets = [("", Exl3Options())] + [(label + "/", opts) for label, opts in map(parse_lever, a.levers)]
    per = {f"{t}c{c}": {"step": [], "synced": [], "host": []} for t, _ in sets for c in a.concurrency}
    reps = Repetitions(run, a.reps, a.reserve_s)
    for rep in reps:
        for tag, opts in sets:
            be.set_options(opts)
            for c in a.concurrency:
                cell = per[f"{tag}c{c}"]
                gen = start_jobs(be, c, a.context, max_new(a))
                try:
                    cell["step"].append(statistics.median(draft_window(gen, a.rounds)))
                    for mode in ("synced", "host"):
                        timer.mode = mode
                        draft_window(gen, a.rounds)
                        timer.mode = None
                        cell[mode].append(timer.take())
                finally:
                    timer.mode = None
                    gen.clear_queue()
        out.update(reps_done=rep + 1, rep_seconds=round(reps.lap(), 1), **{k: summarize(v) for k, v in per.items()})
        run.log(f"repetition {rep + 1}: " + ", ".join(f"{k} step {v['step'][-1]:.2f} ms" for k, v in per.items()))
        run.save()
    import torch

    for tag, opts in sets if torch.cuda.is_available() else ():     # the profile times CUDA kernels
        be.set_options(opts)
        for c in a.concurrency:
            gen = start_jobs(be, c, a.context, max_new(a))
            try:
                out.setdefault(f"{tag}c{c}", {})["profile"] = profile_draft(gen, a.profile_rounds)
            finally:
                gen.clear_queue()
            run.save()
    be.set_options(Exl3Options())
    return out


def summarize(cell: dict) -> dict:
    """Medians over the repetitions: the step, every part synced and on the host, and their sums."""
    parts = sorted({k for r in cell["synced"] + cell["host"] for k in r})
    med = lambda rows, k: round(statistics.median([r[k] for r in rows if k in r]), 3) if any(k in r for r in rows) else None
    out = {"step_ms": round(statistics.median(cell["step"]), 3) if cell["step"] else None,
           "step_ms_reps": [round(x, 3) for x in cell["step"]], "parts": {}}
    for k in parts:
        out["parts"][k] = {"synced_ms": med(cell["synced"], k), "host_ms": med(cell["host"], k)}
    for mode in ("synced", "host"):
        out[f"{mode}_sum_ms"] = round(sum(v[f"{mode}_ms"] or 0.0 for v in out["parts"].values()), 3)
    return out


def max_new(a) -> int:
    """New tokens a job may need in one repetition or profile (fresh jobs each time), every round accepting its
    whole window at worst."""
    return (3 * a.rounds + a.profile_rounds + 8 + max(a.concurrency)) * (WIDTH + 1)


def load(a):
    from toolkit.exl3.backend import Exl3Backend

    per_job = -(-(a.context + max_new(a) + 64) // 256) * 256
    return Exl3Backend.from_dirs(a.work / "target-4.0", a.work / "draft-6.0", cache_tokens=max(a.concurrency) * per_job,
                                 max_concurrency=max(a.concurrency))


def main(argv: list[str] | None = None) -> int:
    from experiments.speed import WORK, synth_pair

    ap = argparse.ArgumentParser(prog="python -m experiments.draft_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=WORK, help="where the synthetic checkpoints live (default /tmp/speed)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--levers", nargs="*", default=[], help="levers timed against stock, interleaved (NAME[=VALUE], "
                    "several joined by '+'), e.g. graph_draft_swa")
    ap.add_argument("--reps", type=int, default=10, help="interleaved repetitions (default 10; fewer if the budget runs out)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per mode and repetition (default 8)")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each dummy job (default 1024)")
    ap.add_argument("--profile-rounds", type=int, default=16, help="rounds under torch.profiler per c (default 16)")
    ap.add_argument("--reserve-s", type=float, default=30.0, help="budget kept for the profile (default 30)")
    ap.add_argument("--budget-s", type=float, default=env_float("DRAFT_STEP_BUDGET_S", 270),
                    help="start no step that does not fit in what is left of it (default: DRAFT_STEP_BUDGET_S, else 270)")
    a = ap.parse_args(argv)
    run = Run("draft_step.json", budget_s=a.budget_s)
    run.results.update(device=device_name(), args={k: str(v) for k, v in vars(a).items()}, width=WIDTH)
    run.step("synth", synth_pair, a.work, False, need_s=60)
    be = run.step("load", load, a, keep=False, need_s=30)
    if be is not None:
        from experiments.harness import free_cuda

        try:
            run.step("measure", measure, run, be, a, keep=False)
        finally:
            free_cuda(be)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
