"""What a change of verify width costs on exllamav3 (issue 16): the SmolLM2 pair's rounds under width schedules.

The 2026-12-03 pair bench saw `auto`'s rarely used widths cost ~2x its common ones (31-45 ms against 17-22 ms at
c=1), which fits exllamav3's graph-captured decode paths (one CUDA graph per (jobs, q_len) slot: an eager run,
then a capture, then replays; a slot is recaptured when the block table grows). This times iterate() rounds of
the held-out prompts under fixed schedules, interleaved over repetitions:

- fix7 (drafter drafts 7: fixed B=8), fix7full (drafts 15, verifies 7: `auto` sitting at 7), fix12full, fix15;
- alt4_12 (4, 12, 4, 12, ...) and churn (a seeded draw from 3, 4, 8, 10, 12, 15 every round), drafting 15.

Per schedule and c: median ms of the rounds after the first `settle` (and per width for the mixed ones),
tokens per round, tokens per second. After `python3 -m experiments.smol_device stage` on the same warm machine:

    source .device/on-device.sh && timeout 300 python -m experiments.switch_cost        (carry [".device"])
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from experiments.harness import Run

ROOT = Path(__file__).resolve().parents[1]
SMOL = Path("/tmp/smol-run")
CHURN = (3, 4, 8, 10, 12, 15)


def schedules(rounds: int, seed: int = 0) -> dict[str, tuple[list[int], bool]]:
    """{name: (width per round, whether the drafter drafts its whole block)}."""
    rng = random.Random(seed)
    return {"fix7": ([7] * rounds, False), "fix7full": ([7] * rounds, True), "fix12full": ([12] * rounds, True),
            "fix15": ([15] * rounds, True), "alt4_12": ([4, 12] * (rounds // 2), True),
            "churn": ([rng.choice(CHURN) for _ in range(rounds)], True)}


def run_schedule(be, prompts: list[list[int]], widths: list[int], full: bool) -> list[tuple[int, float, float]]:
    """(width, ms, tokens per job) of every decoding iterate() of `prompts` as one batch under `widths`."""
    from toolkit.runtime.backend import GenSettings

    B = be.block_size
    settings = GenSettings(max_new_tokens=sum(w + 1 for w in widths) + 2 * B, block_size=None, stop_ids=())
    jobs = be._jobs(prompts, settings)
    gen = be.generator(B - 1)
    gen.enqueue(jobs)
    out = []
    try:
        gen.set_width(0, B - 1 if full else None)
        for _ in range(64):                                   # prefill until every job has emitted a token
            if all(len(j.sequences[0].sequence_ids) > len(p) for j, p in zip(jobs, prompts)):
                break
            gen.iterate()
        for w in widths:
            if gen.num_remaining_jobs() < len(prompts):
                break
            gen.set_width(w, B - 1 if full else None)
            before = [len(j.sequences[0].sequence_ids) for j in jobs]
            be.sync()
            t0 = be.clock()
            gen.iterate()
            be.sync()
            ms = (be.clock() - t0) * 1000.0
            got = statistics.mean(len(j.sequences[0].sequence_ids) - b for j, b in zip(jobs, before))
            out.append((w, ms, got))
    finally:
        if gen.num_remaining_jobs():
            gen.clear_queue()
    return out


def summary(samples: list[list[tuple[int, float, float]]], settle: int) -> dict:
    """Medians over repetitions of the rounds after the first `settle`, overall and per width."""
    kept = [r for rep in samples for r in rep[settle:]]
    if not kept:
        return {}
    per = {}
    for w in sorted({w for w, _, _ in kept}):
        ms = [m for x, m, _ in kept if x == w]
        per[w] = {"ms": round(statistics.median(ms), 3), "rounds": len(ms)}
    rep_tps = [sum(g for _, _, g in rep[settle:]) * 1000.0 / sum(m for _, m, _ in rep[settle:]) for rep in samples
               if rep[settle:]]
    return {"ms": round(statistics.median(m for _, m, _ in kept), 3), "ms_min": round(min(m for _, m, _ in kept), 3),
            "tokens_per_round": round(statistics.mean(g for _, _, g in kept), 3),
            "tok_s_per_job": [round(x, 1) for x in rep_tps], "per_width": per}


def pair_args(p: argparse.ArgumentParser) -> None:
    """--work, --target, --draft: where the staged SmolLM2 pair lies (experiments.smol_device stage)."""
    p.add_argument("--work", type=Path, default=SMOL / "speed")
    p.add_argument("--target", type=Path, default=SMOL / "smollm2-135m-instruct")
    p.add_argument("--draft", type=Path, default=ROOT / "toolkit" / "data" / "smollm2_dflash")


def open_pair(a, max_concurrency: int):
    """The padded pair on exllamav3 (padded into a.work on first use) and the drafter's held-out prompt texts."""
    from toolkit.assets.padding import pad
    from toolkit.exl3.backend import Exl3Backend

    pt, pd = a.work / "pad" / "target", a.work / "pad" / "draft"
    for src, dst in ((a.target, pt), (a.draft, pd)):
        if not (dst / "config.json").is_file():
            pad(str(src), str(dst))
    be = Exl3Backend.from_dirs(pt, pd, max_concurrency=max_concurrency, cache_tokens=16384)
    held = json.loads((a.draft / "heldout.json").read_text())
    return be, [t for ts in held.values() for t in ts]


def measure(run: Run, a) -> dict:
    be, texts = open_pair(a, max(a.concurrency))
    scheds = schedules(a.rounds)
    samples: dict[str, dict[str, list]] = {f"c{c}": {n: [] for n in scheds} for c in a.concurrency}
    for rep in range(a.reps):
        order = list(scheds)
        random.Random(rep).shuffle(order)
        for c in a.concurrency:
            prompts = [be.encode(texts[(rep * c + j) % len(texts)]) for j in range(c)]
            for name in order:
                widths, full = scheds[name]
                samples[f"c{c}"][name].append(run_schedule(be, prompts, widths, full))
        run.log(f"repetition {rep + 1} done")
        run.results["summary"] = {k: {n: summary(v, a.settle) for n, v in d.items()} for k, d in samples.items()}
        run.save()
        if run.left() < 40:
            break
    be.close()
    return run.results["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.switch_cost", description=__doc__.split("\n\n")[0])
    pair_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=48, help="rounds per schedule and repetition (default 48)")
    p.add_argument("--settle", type=int, default=6, help="rounds left out of the medians at the start (default 6)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=240.0)
    a = p.parse_args(argv)
    run = Run("switch_cost.json", budget_s=a.budget_s)
    run.step("measure", measure, run, a)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
