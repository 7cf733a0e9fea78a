"""Decoding speed on exllamav3: round costs of the real shape with and without each lever, the host time our code
adds per round, the projected speedup at the published tau, and the SmolLM2 pair's measured tok/s.

Mode `shape`, one call (about 6-8 minutes; results to $OUT/speed.json after every step):

    source .device/on-device.sh && timeout 570 python -m experiments.speed shape                (carry [".device"])

1. synthesise (toolkit.synthetic, on the GPU) the Qwen3.6-35B-A3B target at 4.0 bpw and its DFlash drafter at
   6.0 bpw into /tmp/speed (skipped when present: a warm machine keeps /tmp), and load them (Exl3Backend);
2. t_AR (the Generator without drafter) and t_round(w) for w in {0, 1, 3, 5, 7, 11, 15} (w = 0: an AR round of
   the speculative Generator, drafter K/V kept: what the policy's AR rounds cost, reported against t_AR as
   `ar_in_spec_over_ar`) at c in {1, 4, 8, 16}, stock and with each lever of `--levers` (default the adopted
   levers together, graph_draft_swa+grouped_moe; NAME[=VALUE], "A+B" joins levers), after `--warmup` untimed
   passes (default 1: a process's first pass meets every shape cold), >= 10 repetitions interleaved: every repetition times every (c, setting),
   each on c steady-state dummy jobs with 1k-token prompts, one untimed round per width then one timed pass over
   the widths (toolkit.exl3.calibrate.time_rounds, the same timer as the backend's calibration); medians and
   spread per cell;
3. host time at c=1, w=7: wall ms per round of exllamav3's Generator, of our recording subclass (the capture), and
   of our whole policy path (full-block capture, Round assembly, hindsight), `--profile-reps` interleaved windows
   each (medians: what our code adds), the last one under torch.profiler (GPU busy and idle);
4. the projection at the published tau (DF-16 7.63, DF-8 5.74; geometric per-position acceptance, see
   toolkit.benchmark.projection) for exllamav3's defaults and for the policy, per setting and c.
Random weights route MoE tokens uniformly (real routing is skewed), so verify costs are an upper bound.
With `--draft mtp` the drafter is the target's own MTP head instead: the target is synthesised from
qwen3.6-35b-a3b-mtp.json (the same decoder plus the head) into target-4.0-mtp, loaded with `--draft mtp`, and
steps 1-2 time its rounds at w in 0..4 (one head step per drafted id; `--widths` is cut to 4); the host profile,
the round budgets and the DFlash projection are skipped. Time DFlash beside it with a plain `shape` call.

Mode `pair`, the SmolLM2-135M pair with its shipped drafter (toolkit/data/smollm2_dflash), after the target was
staged on the same warm machine (experiments/smol_device.py: calls carry the GGUF parts, the last runs
`python3 -m experiments.smol_device stage`), then within the 30 s idle window:

    source .device/on-device.sh && timeout 570 python -m experiments.speed pair                 (carry [".device"])

pads both to hidden 768 (toolkit.assets.padding, as `smol_device exl3` does) and runs toolkit.bench on
exllamav3: AR, fixed B=16, fixed B=8 and auto at c in {1, 4, 8} on the held-out prompts, >= 10 repetitions
interleaved, greedy output checked against AR (the lossless column), `--levers` as extra cells; bench.json
and bench.png go to $OUT/pair, the summary and the pair's targets to $OUT/speed.json ("within 3 % of the best
fixed width" from auto's paired ratio per repetition, bench.json's "auto_over_best_fixed").
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from statistics import median

from experiments.harness import Repetitions, Run, device_name, env_float, warm_up
from toolkit.exl3.options import ADOPTED
from toolkit.mtp import DEPTH, MTP

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "quantize" / "shapes"
WORK = Path("/tmp/speed")
SMOL = Path("/tmp/smol-run")
WIDTHS = (0, 1, 3, 5, 7, 11, 15)
MTP_WIDTHS = tuple(range(DEPTH + 1))                # the MTP head drafts up to DEPTH ids a round
ADOPTED_LEVERS = ADOPTED.tag.replace(",", "+")      # the toolkit's defaults as one `--levers` setting
SHAPE_LEVERS = (ADOPTED_LEVERS,)                    # `--levers` times others against stock


# -- pure helpers (tested on the CPU) --------------------------------------------------------------------------


def cell_summary(samples: dict) -> dict:
    """{key: [ms per repetition]} -> {key: spread}."""
    from toolkit.benchmark.projection import spread

    return {str(k): spread(v) for k, v in samples.items()}


def projection_rows(ar: dict[int, list[float]], sets: dict[str, dict[int, dict[int, list[float]]]], taus) -> list[dict]:
    """Projected speedups per setting, c and tau from the repetitions' medians (t_AR from the drafter-less Generator)."""
    from toolkit.costs.table import CostTable
    from toolkit.benchmark.projection import project, spread

    rows = []
    for tag, per_c in sets.items():
        for c, per_w in sorted(per_c.items()):
            pts = {w: spread(ts)["median"] for w, ts in per_w.items() if ts}
            if c not in ar or not ar[c] or 0 not in pts or len(pts) < 2:
                continue
            table = CostTable({c: pts})
            for name, tau, B in taus:
                if B - 1 in pts:
                    rows.append({"setting": tag, "name": name, **project(table, c, tau, B, t_ar=spread(ar[c])["median"])})
    return rows


def ar_overhead(ar: dict[int, list[float]], stock: dict[int, dict[int, list[float]]]) -> dict[str, float]:
    """Per c: an AR round of the speculative Generator (w = 0, drafter K/V kept) over a plain AR step."""
    from statistics import median

    return {str(c): median(stock[c][0]) / median(ar[c]) for c in ar if ar[c] and stock.get(c, {}).get(0)}


def shape_targets(rows: list[dict]) -> dict:
    """The real-shape targets at c=1, DF-16: the policy with the toolkit's defaults (ADOPTED, when timed as a
    lever; else stock) >= 1.3x exllamav3's stock defaults and >= 2.2x AR."""
    pick = {x["setting"]: x for x in rows if x["concurrency"] == 1 and x["name"] == "DF-16"}
    stock = pick.get("stock")
    if stock is None:
        return {}
    setting = ADOPTED_LEVERS if ADOPTED_LEVERS in pick else "stock"
    r = pick[setting]
    over = r["policy_speedup"] / stock["default_speedup"]
    return {"setting": setting, "policy_over_defaults": over, "needed_over_defaults": 1.3,
            "policy_over_ar": r["policy_speedup"], "needed_over_ar": 2.2, "policy_width": r["policy_width"],
            "pass": over >= 1.3 and r["policy_speedup"] >= 2.2}


# -- shape mode ------------------------------------------------------------------------------------------------


def target_dir(work: Path, routing: str, draft: str = "dflash") -> Path:
    name = "target-4.0" if routing == "random" else f"target-4.0-{routing}"
    return work / (f"{name}-mtp" if draft == MTP else name)


def synth_pair(work: Path, resynth: bool, routing: str = "random", draft: str = "dflash") -> dict:
    import torch

    from toolkit.synthetic import synth

    out = {}
    pair = [("target", "qwen3.6-35b-a3b-mtp.json", 4, target_dir(work, routing, draft))] if draft == MTP else [
        ("target", "qwen3.6-35b-a3b.json", 4, target_dir(work, routing)),
        ("draft", "qwen3.6-35b-a3b-dflash.json", 6, work / "draft-6.0")]
    for key, cfg, bits, folder in pair:
        if (folder / "config.json").is_file() and not resynth:          # complete: synth renames it in at the end
            out[key] = {"reused": str(folder)}
            continue
        extra = {"routing": routing} if key == "target" else {}
        out[key] = synth(str(SHAPES / cfg), bits, str(folder), device="cuda", overwrite=True, quiet=True, **extra)
    torch.cuda.empty_cache()
    return out


def load_shape(a, routing: str = "random"):
    from toolkit.exl3.backend import Exl3Backend

    per_job = math.ceil((a.context + 2 * sum(w + 1 for w in a.widths) + 64) / 256) * 256
    draft = MTP if a.draft == MTP else a.work / "draft-6.0"
    return Exl3Backend.from_dirs(target_dir(a.work, routing, a.draft), draft, cache_tokens=max(a.concurrency) * per_job,
                                 max_concurrency=max(a.concurrency))


def time_shape(run: Run, be, a, key: str = "timing", share: float = 1.0) -> dict:
    """The interleaved repetitions: every (c, setting) timed once per repetition; partial results kept under
    run.results[key]. `share`: the part of the budget left (after --reserve-s) these repetitions may use."""
    from toolkit.exl3.options import Exl3Options, parse_lever
    from toolkit.exl3.calibrate import medians, time_rounds

    sets = [("stock", Exl3Options())] + [parse_lever(x) for x in a.levers]
    ar: dict[int, list[float]] = {c: [] for c in a.concurrency}
    own_ar: dict[str, dict[int, list[float]]] = {t: {c: [] for c in a.concurrency} for t, _ in sets[1:]}
    per: dict[str, dict[int, dict[int, list[float]]]] = {t: {c: {w: [] for w in a.widths} for c in a.concurrency} for t, _ in sets}
    out = run.results.setdefault(key, {})

    def plain_ar(c: int) -> float:
        return medians(time_rounds(be, c, [0], reps=a.passes, context=a.context, speculative=False))[0]

    def one_pass() -> tuple[dict[int, float], dict[tuple[str, int, int], float]]:
        """t_AR per c (stock, and each setting's own under ("ar", tag)), and t_round per (setting, c, w): one timed
        pass over every cell."""
        t_ar, t_round = {}, {}
        for c in a.concurrency:
            be.set_options(Exl3Options())
            t_ar[c] = plain_ar(c)
            for tag, opts in sets:
                be.set_options(opts)
                if tag != "stock":
                    t_round["ar", tag, c] = plain_ar(c)
                for w, ms in medians(time_rounds(be, c, a.widths, reps=a.passes, context=a.context)).items():
                    t_round[tag, c, w] = ms
        be.set_options(Exl3Options())
        return t_ar, t_round

    warm_up(run, out, a.warmup, lambda i: one_pass())
    reps = Repetitions(run, a.reps, a.reserve_s + (1 - share) * max(0.0, run.left() - a.reserve_s))
    for rep in reps:
        t_ar, t_round = one_pass()
        for c, ms in t_ar.items():
            ar[c].append(ms)
        for key, ms in t_round.items():
            if key[0] == "ar":
                own_ar[key[1]][key[2]].append(ms)
            else:
                per[key[0]][key[1]][key[2]].append(ms)
        rep_s = reps.lap()
        out.update(reps_done=rep + 1, rep_seconds=round(rep_s, 1), context=a.context, widths=list(a.widths),
                   concurrency=list(a.concurrency), settings=[t for t, _ in sets],
                   ar_ms={str(c): cell_summary({"ms": v})["ms"] for c, v in ar.items()},
                   own_ar_ms={t: {str(c): cell_summary({"ms": v})["ms"] for c, v in pc.items()} for t, pc in own_ar.items()},
                   round_ms={t: {str(c): cell_summary(pw) for c, pw in pc.items()} for t, pc in per.items()})
        run.log(f"repetition {rep + 1}: {rep_s:.0f} s; c=1 stock: AR {ar[min(a.concurrency)][-1]:.2f} ms, "
                + ", ".join(f"w={w} {per['stock'][min(a.concurrency)][w][-1]:.2f}" for w in a.widths))
        run.save()
    return {"ar": ar, "sets": per, "own_ar": own_ar}


def run_shape(run: Run, a) -> None:
    from experiments.budget import budgets, distinct_experts, profile_host
    from experiments.harness import free_cuda
    from toolkit.benchmark.projection import ASSUMPTION, PUBLISHED

    if a.draft == MTP:
        a.widths = sorted({w for w in a.widths if w <= DEPTH}) if a.widths != list(WIDTHS) else list(MTP_WIDTHS)
    for i, routing in enumerate(a.routing):
        key = "" if routing == "random" else f"_{routing}"
        run.step(f"synth{key}", synth_pair, a.work, a.resynth, routing, a.draft, need_s=60)
        be = run.step(f"load{key}", load_shape, a, routing, keep=False, need_s=30)
        if be is None:
            return
        try:
            run.results[f"distinct_experts{key}"] = distinct_experts(be)
            data = run.step(f"timing{key}", time_shape, run, be, a, f"timing{key}", 1 / (len(a.routing) - i), keep=False)
            run.results[f"engine{key}"] = be.engine_report()      # e.g. how the forwards ran (forward_graphs)
            if i == 0 and a.draft != MTP:
                if a.identical:
                    run.step("identical", identical, be, a, need_s=60)
                run.step("profile", profile_host, be, a, need_s=20)
                if a.budget:
                    run.step("budget", budgets, be, a, need_s=30)
            if data:
                taus = [(k, t, B) for k, (t, B) in PUBLISHED.items()]
                rows = projection_rows(data["ar"], data["sets"], taus)
                for r in rows:
                    r["routing"] = routing
                    own = data["own_ar"].get(r["setting"], {}).get(r["concurrency"])
                    if own:
                        r["own_ar_speedup"] = round(median(data["ar"][r["concurrency"]]) / median(own), 3)
                run.results[f"projection{key}"] = {"assumption": ASSUMPTION, "rows": rows, "targets": shape_targets(rows)}
                run.results[f"ar_in_spec_over_ar{key}"] = ar_overhead(data["ar"], data["sets"]["stock"])
                run.save()
        finally:
            free_cuda(be)


def identical(be, a) -> dict:
    """forward_graphs off and on over --identical dummy prompts: greedy tokens must match, and every replay must
    equal the same call run eagerly (experiments/exl3_loop.py)."""
    from experiments.exl3_loop import graphs_identical, graphs_twin
    from toolkit.exl3.calibrate import dummy_prompts

    prompts = dummy_prompts(a.identical, 300, be.vocab_size)
    return {**graphs_identical(be, prompts, B=8, max_new=40), "twin": graphs_twin(be, prompts, B=8, max_new=40)}


# -- entry -----------------------------------------------------------------------------------------------------


def block_arg(text: str):
    return text if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.speed", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("shape", help="real-shape round costs, levers, host time, projection (synthetic weights)")
    s.add_argument("--work", type=Path, default=WORK, help="where the synthetic checkpoints live (default /tmp/speed)")
    s.add_argument("--resynth", action="store_true", help="synthesise again even when present")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    s.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="verify widths (0 = AR round with the drafter loaded)")
    s.add_argument("--levers", nargs="*", default=list(SHAPE_LEVERS), help="levers timed against stock (NAME[=VALUE])")
    s.add_argument("--reps", type=int, default=10, help="interleaved repetitions (default 10; fewer if the budget runs out)")
    s.add_argument("--passes", type=int, default=1, help="timed passes over the widths per repetition (default 1)")
    s.add_argument("--context", type=int, default=1024, help="prompt tokens of each dummy job (default 1024)")
    s.add_argument("--profile-rounds", type=int, default=24, help="rounds per timed window of each variant (default 24)")
    s.add_argument("--profile-reps", type=int, default=5, help="interleaved windows per variant in the host-time "
                   "profile; the last one under torch.profiler (default 5)")
    s.add_argument("--reserve-s", type=float, default=60.0, help="budget kept for the profile and projection (default 60)")
    s.add_argument("--warmup", type=int, default=1, help="untimed passes over every cell before the repetitions (default 1)")
    s.add_argument("--routing", nargs="+", choices=["random", "skewed"], default=["random"],
                   help="synthetic target routing, each timed in turn: random (the default and upper bound) and/or "
                        "skewed (toolkit.synth --routing skewed: about the published distinct-expert counts)")
    s.add_argument("--budget", nargs="*", default=["1:AR", "1:7", "1:15", "4:AR", "4:7"],
                   help="round budgets C:W to profile (W a width or AR), stock and the last --levers setting")
    s.add_argument("--draft", choices=["dflash", MTP], default="dflash", help="the drafter timed: the synthetic "
                   "DFlash drafter (default), or mtp: the target's own MTP head (widths 0-4)")
    s.add_argument("--identical", type=int, default=0, help="after the timing, forward_graphs off and on over this "
                   "many dummy prompts, greedy tokens compared (default 0: skip)")
    p = sub.add_parser("pair", help="the SmolLM2 pair: tok/s of AR, B=16, B=8 and auto, same output")
    p.add_argument("--work", type=Path, default=SMOL / "speed", help="padded copies go here (default /tmp/smol-run/speed)")
    p.add_argument("--target", type=Path, default=Path(os.environ.get("SMOL_TARGET", SMOL / "smollm2-135m-instruct")))
    p.add_argument("--draft", type=Path, default=Path(os.environ.get("SMOL_DRAFT", ROOT / "toolkit" / "data" / "smollm2_dflash")))
    p.add_argument("--block-sizes", type=block_arg, nargs="+", default=["auto", 16, 8])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--limit", type=int, default=8, help="held-out prompts per cell (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--levers", nargs="*", default=[], help="exllamav3 levers as extra cells (default none)")
    p.add_argument("--draft-bits", type=float, default=0, help="bench an EXL3 copy of the drafter at these bits (0: as given)")
    p.add_argument("--trace", action="store_true", help="write every iterate() (cell, width, jobs, ms, tokens) to trace.jsonl")
    for q in (s, p):
        q.add_argument("--budget-s", type=float, default=env_float("SPEED_BUDGET_S", 540),
                       help="start no step that does not fit in what is left of it (default: SPEED_BUDGET_S, else 540)")
    a = ap.parse_args(argv)
    run = Run("speed.json", budget_s=a.budget_s)
    run.results.update(mode=a.mode, device=device_name(), args={k: str(v) for k, v in vars(a).items()})
    if a.mode == "shape":
        run_shape(run, a)
    else:
        from experiments.pair_mode import run_pair

        a.work.mkdir(parents=True, exist_ok=True)
        run_pair(run, a)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
