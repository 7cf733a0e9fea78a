"""The hook's overhead for experiments/device_check.py (check `overhead`): exllamav3's own Generator loop against
the loop with the toolkit's capture hook, and with the hook plus the Round assembly, on one and on 24 jobs."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from experiments.exl3_timing import run_jobs
from experiments.harness import free_cuda
from experiments.lossless import doc_prompts
from toolkit.runtime.backend import GenSettings

if TYPE_CHECKING:
    from experiments.device_check import Ctx


def check_overhead(ctx: Ctx) -> dict:
    """Seconds per iterate() of the library's own loop, the loop with our hook, and the hook plus the Round
    assembly generate_many does; interleaved repetitions, medians; plus our own code's share timed directly."""
    from toolkit.exl3.backend import Exl3Backend

    be = Exl3Backend.from_dirs(ctx.fix["target"], ctx.fix["draft_bf16"], cache_tokens=32 * 512, max_concurrency=32)
    modes = {"plain": dict(hooked=False), "hook_only": dict(hooked=True, rounds=False), "hook_and_rounds": dict(hooked=True)}
    out = {}
    try:
        prompts = doc_prompts(be.tokenizer, n=24)
        st = GenSettings(max_new_tokens=128, block_size=16)
        for name, batches in (("conc1", [[p] for p in prompts[:4 if ctx.quick else 8]]), ("conc24", [prompts])):
            per = {k: [] for k in modes}
            iters, direct = {}, []
            for rep in range(4 if ctx.quick else 6):       # interleaved; rep 0 is a warm-up
                tot = {k: [0.0, 0] for k in per}
                ours = 0.0
                for batch in batches:
                    for k in ("hook_and_rounds", "plain", "hook_only"):
                        loop = run_jobs(be, batch, st, **modes[k])
                        tot[k][0] += loop.seconds
                        tot[k][1] += loop.iterations
                        if k == "hook_and_rounds":
                            ours += loop.overhead_s
                for k, (secs, it) in tot.items():
                    per[k].append(secs / it)
                    iters[k] = it
                direct.append(ours / tot["hook_and_rounds"][0] * 100)
            med = {k: statistics.median(v[1:]) for k, v in per.items()}
            out[name] = {f"{k}_ms_per_round": round(v * 1000, 4) for k, v in med.items()}
            out[name].update({f"{k}_overhead_pct": round((med[k] / med["plain"] - 1) * 100, 2) for k in ("hook_only", "hook_and_rounds")})
            out[name]["direct_capture_and_rounds_pct"] = round(statistics.median(direct[1:]), 3)   # timed inside our code
            out[name].update(rounds=iters, all_ms={k: [round(x * 1000, 3) for x in v] for k, v in per.items()})
        return out
    finally:
        free_cuda(be)
