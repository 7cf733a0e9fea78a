"""`python -m experiments.speed pair`'s library: the SmolLM2 pair (padded for exllamav3, optionally with an EXL3 copy
of the drafter: `exl3_draft`, since exllamav3's graph-captured attention, the `graph_draft_swa` lever, takes only
EXL3 projections) through toolkit.bench, and the pair's targets read from its result."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from experiments.harness import Run
from experiments.round_trace import RoundTrace, summarize
from toolkit.core.errors import ToolkitError
from toolkit.quant.convert import converter_args, pin_tap_shift, run_converter


def pair_targets(result: dict) -> dict:
    """The pair's targets: auto >= 2.0x AR at c=1, within 3 % of the best fixed width at every c, never
    more than 5 % slower than AR, and lossless. "Within 3 %" reads the paired ratio per repetition (the median of
    bench.json's "auto_over_best_fixed", also given as "paired", with the first repetition apart from the median of
    the later ones) when the cell has one; older files: the medians. The auto cell's new-shape excess and count of
    plain AR requests come along when its policy recorded them."""
    out = {}
    for c in result["concurrency"]:
        cells = [x for x in result["cells"] if x["concurrency"] == c and not x.get("lever")]
        auto = next((x for x in cells if x["block_size"] == "auto"), None)
        fixed = [x for x in cells if isinstance(x["block_size"], int)]
        if auto is None:
            continue
        best = max((x["tok_s"] for x in fixed), default=0.0)
        paired = auto.get("auto_over_best_fixed")
        ratio = paired["median"] if paired else (auto["tok_s"] / best if best else None)
        speedup = auto["speedup"] if auto.get("speedup") is not None else auto["tok_s"] / auto["ar_tok_s"]  # never drafted
        row = {"auto_speedup": speedup, "auto_over_best_fixed": ratio,
               "lossless": auto["lossless"], "not_slower_than_ar": speedup >= 0.95,
               "within_3pct_of_best_fixed": ratio is None or ratio >= 0.97}
        if paired:
            row["paired"] = {k: paired[k] for k in ("block_size", "median", "min", "max", "n")}
            ratios = paired.get("ratios") or []
            if len(ratios) > 1:                  # the cold first repetition apart (new shapes, first calibration)
                row["paired"].update(first=ratios[0], later_median=statistics.median(ratios[1:]))
        costs = auto.get("costs") or {}
        row.update({k: costs[k] for k in ("source", "plain_ar_requests") if k in costs})
        if c == 1:
            row["at_least_2x_ar"] = speedup >= 2.0
        out[str(c)] = row
    return out


def heldout_jsonl(src: Path, dst: Path) -> Path:
    held = json.loads(src.read_text())
    dst.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for c, ps in held.items() for p in ps))
    return dst


def run_pair(run: Run, a) -> None:
    from toolkit.assets.padding import pad
    from toolkit.bench import BenchOptions, bench

    missing = [p for p in (a.target, a.draft) if not (p / "config.json").is_file()]
    if missing:
        run.errors["inputs"] = f"{missing[0]} is missing: stage the target first (python3 -m experiments.smol_device stage)"
        return
    pt, pd = a.work / "pad" / "target", a.work / "pad" / "draft"

    def padded() -> list[str]:
        return [str(p if (p / "config.json").is_file() else pad(str(src), str(p))) for src, p in ((a.target, pt), (a.draft, pd))]

    run.step("pad", padded)
    if a.draft_bits:                               # graph_draft_swa needs EXL3 projections
        pd = run.step("draft_exl3", exl3_draft, pd, pd.with_name(f"draft-{a.draft_bits:g}bpw"), a.draft_bits, keep=False, need_s=60)
        if pd is None:
            return
    prompts = heldout_jsonl(a.draft / "heldout.json", a.work / "heldout.jsonl")

    def measure() -> dict:
        r = bench(BenchOptions(target=str(pt), draft=str(pd), backend="exllamav3", prompts=str(prompts), block_sizes=a.block_sizes,
                  concurrency=a.concurrency, max_new_tokens=a.max_new_tokens, limit=a.limit, reps=a.reps,
                  out=str(run.path.parent / "pair"), quiet=True, **({"levers": a.levers} if a.levers else {}),
                  minutes=max(0.5, (run.left() - 150) / 60)))     # loading (~25-90 s) comes first: a margin
        keep = ("block_size", "concurrency", "lever", "tok_s", "speedup", "lossless", "tau", "round_ms", "t_ar_ms",
                "width_histogram", "spread", "tok_s_reps", "auto_over_best_fixed")
        return {"ar": [{k: c[k] for k in ("concurrency", "tok_s", "round_ms", "spread")} for c in r["ar"]],
                "cells": [{k: c[k] for k in keep if k in c} for c in r["cells"]], "targets": pair_targets(r),
                "reps": r["reps"], "reps_planned": r["reps_planned"]}

    trace = RoundTrace().install() if a.trace else None
    try:
        run.step("bench", measure, need_s=60)
    finally:
        if trace is not None:
            trace.remove()
            trace.write(run.path.parent / "trace.jsonl")
            run.results["trace"] = summarize(trace.rows)
            run.save()


def exl3_draft(source: Path, out: Path, bits: float) -> Path:
    """`out`, an EXL3 copy of the drafter `source` at `bits` bpw, uncalibrated, by exllamav3's convert_model (reused
    when complete; written to a temp folder renamed when complete, nothing left on failure)."""
    if (out / "config.json").is_file():
        return out
    part, work = out.with_name(out.name + ".part"), out.with_name(out.name + ".work")
    for p in (part, work):
        shutil.rmtree(p, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        rc = run_converter(converter_args(source, part, work, bits, None, None, None), out.with_name(out.name + ".log"))
        if rc != 0 or not (part / "config.json").is_file():
            raise ToolkitError(f"converting {source} at {bits} bpw failed (exit {rc}); log {out.name}.log")
        tap_shift = (json.loads((source / "config.json").read_text()).get("dflash_config") or {}).get("tap_shift", 0)
        pin_tap_shift(part, int(tap_shift or 0))
        if (source / "heldout.json").is_file():      # the bench reads the held-out prompts beside the drafter
            shutil.copy(source / "heldout.json", part / "heldout.json")
        part.rename(out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
