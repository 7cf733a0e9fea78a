"""Two GPUs: the target split across cards (per-device budgets, and tensor-parallel), the DFlash drafter beside
it, against the same models on one GPU in the same run.

Not run yet (no two-GPU machine was lent when it was written). One call on kind nvidia-h200-x2, about 8-9 minutes
(results to $OUT/two_gpu.json after every step):

    source .device/on-device.sh && timeout 570 python -m experiments.two_gpu shape                (carry [".device"])

1. synthesise (toolkit.synthetic, as experiments/speed.py does) the Qwen3.6-35B-A3B target at 4.0 bpw and its
   DFlash drafter at 6.0 bpw into /tmp/two_gpu (skipped when present);
2. for each placement, in one process: `one GPU` (everything on cuda:0), `split 16,16` (the target 50/50 across
   the two H200s, each device's target budget capped at 16 GB as a home user's cards would be, the drafter on
   cuda:0 on top of its budget: `used_gib` per device shows what a 16 GB card would have to hold), and `split 16,16, tensor-parallel`: load through Exl3Backend.from_dirs(split=...), record the memory
   pre-check's per-device estimate, then t_AR (the Generator without drafter) and t_round at B=8 and B=16
   (w = 7 and 15) for c = 1 and 4 (exl3_calibrate.time_rounds: steady-state dummy jobs with 1k-token prompts,
   --reps interleaved repetitions, medians), and the peak memory per device (torch's peak allocated and the
   device's used memory after the timing);
3. the ratios split / one GPU per cell.

Mode `pair`: the SmolLM2-135M padded pair (staged as for experiments/speed.py pair: experiments/smol_device.py),
greedy on the held-out prompts on one GPU, then with the target split across both GPUs (device 0's budget half the
target's estimated size, so the layers do spill onto cuda:1) and the drafter on cuda:0, then with the drafter on
cuda:1: the tokens must be identical, and tau the same:

    source .device/on-device.sh && timeout 570 python -m experiments.two_gpu pair                 (carry [".device"])

Random weights route MoE tokens uniformly (real routing is skewed), so the shape mode's verify costs are an
upper bound; only the comparison between placements is the point.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from experiments.harness import Run, device_name

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/two_gpu")
SMOL = Path("/tmp/smol-run")
WIDTHS = {8: 7, 16: 15}                 # B -> verify width of a full round
PLACEMENTS = (("one GPU", {}), ("split 16,16", {"gpu_split": "16,16"}),
              ("split 16,16, tensor-parallel", {"gpu_split": "16,16", "tensor_parallel": True}))


# -- pure helpers (CPU) ----------------------------------------------------------------------------------------


def ratios(cells: dict[str, dict], base: str = "one GPU") -> dict[str, dict[str, float]]:
    """{placement: {cell: its ms / the one-GPU ms}} for every placement but the base."""
    ref = cells.get(base) or {}
    return {p: {k: round(v / ref[k], 3) for k, v in c.items() if ref.get(k)} for p, c in cells.items() if p != base}


def spill_split(target_bytes: int, other_gb: float = 8.0) -> str:
    """A --gpu-split that puts about half of a target of `target_bytes` on cuda:0 and the rest on cuda:1."""
    return f"{max(target_bytes / 2 / 1024**3, 0.01):.3f},{other_gb:g}"


# -- on the device ---------------------------------------------------------------------------------------------


def peaks() -> dict[str, dict]:
    import torch

    out = {}
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out[f"cuda:{i}"] = {"peak_allocated_gib": round(torch.cuda.max_memory_allocated(i) / 1024**3, 2),
                            "used_gib": round((total - free) / 1024**3, 2)}
    return out


def reset_peaks() -> None:
    import torch

    for i in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(i)


def estimate(a, split) -> list[dict]:
    from toolkit.exl3.memory import GIB, check_memory

    needs = check_memory(a.work / "target-4.0", a.work / "draft-6.0", cache_tokens(a), max(a.concurrency), "", split)
    return [{"device": n.device, "target_gib": round(n.target / GIB, 2), "draft_gib": round(n.draft / GIB, 2),
             "layers": n.layers, "free_gib": round(n.free / GIB, 1)} for n in needs if n.used]


def cache_tokens(a) -> int:
    per_job = math.ceil((a.context + 6 * sum(w + 1 for w in (0, *WIDTHS.values())) + 64) / 256) * 256   # time_rounds' 1 + 5 passes
    return max(a.concurrency) * per_job


def time_placement(run: Run, a, name: str, kw: dict) -> dict:
    """Load the pair with this placement, time t_AR and t_round(B) per c, and the peak memory per device."""
    from experiments.harness import free_cuda
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.exl3.calibrate import medians, time_rounds
    from toolkit.runtime.placement import GpuSplit

    split = GpuSplit.of(**kw)
    est = estimate(a, split)
    reset_peaks()
    be = Exl3Backend.from_dirs(a.work / "target-4.0", a.work / "draft-6.0", cache_tokens=cache_tokens(a),
                               max_concurrency=max(a.concurrency), split=split)
    try:
        loaded = peaks()
        ms: dict[str, list[float]] = {}
        for _ in range(a.reps):
            for c in a.concurrency:
                ms.setdefault(f"AR c={c}", []).append(
                    medians(time_rounds(be, c, [0], context=a.context, speculative=False))[0])
                got = medians(time_rounds(be, c, sorted(WIDTHS.values()), context=a.context))
                for B, w in WIDTHS.items():
                    ms.setdefault(f"B={B} c={c}", []).append(got[w])
        return {"split": split.tag, "estimate": est, "after_load": loaded, "peak": peaks(),
                "ms": {k: round(sorted(v)[len(v) // 2], 3) for k, v in ms.items()}, "reps": a.reps}
    finally:
        free_cuda(be)


def run_shape(run: Run, a) -> None:
    from experiments.speed import synth_pair

    run.results["device"] = device_name()
    run.step("synth", synth_pair, a.work, a.resynth, need_s=60)
    cells = {}
    for name, kw in PLACEMENTS:
        got = run.step(name, time_placement, run, a, name, kw, need_s=60)
        if got:
            cells[name] = got["ms"]
    run.results["ratio_to_one_gpu"] = ratios(cells)
    run.save()


def greedy(be, prompts: list[list[int]], max_new: int) -> dict:
    from toolkit.runtime.backend import GenSettings
    from toolkit.runtime.events import summarize

    rounds = {i: [] for i in range(len(prompts))}
    for i, r in be.generate_many(prompts, GenSettings(max_new_tokens=max_new, block_size=16)):
        rounds[i].append(r)
    return {"tokens": [[t for r in rounds[i] for t in r.tokens] for i in rounds],
            "tau": round(summarize([r for rs in rounds.values() for r in rs]).tau, 4)}


def run_pair(run: Run, a) -> None:
    import json

    from experiments.harness import free_cuda
    from toolkit.assets.padding import pad
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.exl3.memory import weight_bytes
    from toolkit.runtime.placement import GpuSplit

    pt, pd = a.work / "pad" / "target", a.work / "pad" / "draft"
    for src, p in ((a.target, pt), (a.draft, pd)):
        if not (p / "config.json").is_file():
            run.step(f"pad {p.name}", lambda s=src, q=p: str(pad(str(s), str(q))))
    held = json.loads((a.draft / "heldout.json").read_text())
    texts = [p for ps in held.values() for p in ps][: a.limit]
    spill = spill_split(weight_bytes(pt))
    runs = {}
    for name, split in (("one GPU", GpuSplit()), (f"split {spill}", GpuSplit.of(spill)),
                        (f"split {spill}, drafter cuda:1", GpuSplit.of(spill, draft_device=1))):
        def decode(split=split):
            be = Exl3Backend.from_dirs(pt, pd, cache_tokens=len(texts) * 1024, max_concurrency=len(texts), split=split)
            try:
                return greedy(be, [be.encode(t) for t in texts], a.max_new_tokens)
            finally:
                free_cuda(be)

        got = run.step(name, decode, keep=False, need_s=30)
        if got:
            runs[name] = got
            run.steps[name] = {"tau": got["tau"], "tokens": sum(map(len, got["tokens"]))}
    base = runs.get("one GPU")
    run.results["identical_to_one_gpu"] = {k: v["tokens"] == base["tokens"] for k, v in runs.items()} if base else {}
    run.results["same_tau"] = {k: v["tau"] == base["tau"] for k, v in runs.items()} if base else {}
    run.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.two_gpu", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("shape", help="real-shape t_AR / t_round per placement, peak memory per device")
    s.add_argument("--work", type=Path, default=WORK)
    s.add_argument("--resynth", action="store_true")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    s.add_argument("--reps", type=int, default=5, help="interleaved repetitions per placement (default 5)")
    s.add_argument("--context", type=int, default=1024)
    p = sub.add_parser("pair", help="the SmolLM2 padded pair: split output identical to one GPU, same tau")
    p.add_argument("--work", type=Path, default=SMOL / "two_gpu")
    p.add_argument("--target", type=Path, default=Path(os.environ.get("SMOL_TARGET", SMOL / "smollm2-135m-instruct")))
    p.add_argument("--draft", type=Path, default=Path(os.environ.get("SMOL_DRAFT", ROOT / "toolkit" / "data" / "smollm2_dflash")))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    run = Run("two_gpu.json" if a.mode == "shape" else "two_gpu_pair.json", budget_s=540)
    (run_shape if a.mode == "shape" else run_pair)(run, a)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
