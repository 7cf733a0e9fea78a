"""The SmolLM2 pair on exllamav3, after smol_device run: tau per backend, speedup vs AR, tau per EXL3 bitrate.

Runs right after `python -m experiments.smol_device run` on the same warm machine (inside its 30 s idle window),
reading the prepared target and the freshly trained drafter from /tmp/smol-run (or SMOL_TARGET / SMOL_DRAFT):

    source .device/on-device.sh && python -m experiments.smol_exl3        (carry [".device"]; writes $OUT/exl3.json)

1. `toolkit.assets.padding` both to hidden 768 (exllamav3 1.6.5 needs 128-aligned widths; same function);
2. `toolkit.eval_tau --backend exllamav3` on all held-out prompts, B = 8 and 16 (compare with the torch backend's
   tau from call 2 and from the CPU);
3. `toolkit.bench --backend exllamav3` on held-out prompts: AR and speculative in one process, c = 1 and 8;
4. `toolkit.quant` with quantize/smollm2-135m-dflash.toml at 2, 3, 4, 5, 6 and 8 bpw, calibrated and not
   (its own check: KL, top-1 and tau through the torch runtime with dequantized weights);
5. tau of every EXL3 drafter on exllamav3 itself, on all held-out prompts.
Stages run in that order and results are written after each, so a cut-off call still returns what was done.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from experiments.harness import Run, device_name, env_float
from experiments.pair_mode import heldout_jsonl

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/smol-run")
RECIPE = ROOT / "quantize" / "smollm2-135m-dflash.toml"


def tau_only(res: dict) -> dict:
    return {"tau": res["tau"], "prompts": res["prompts"], "complete": res["complete"],
            "accept_16": {c: d.get("16", {}).get("accept_per_position", [])[:4] for c, d in res["detail"].items()}}


def measure(run: Run, target: Path, draft: Path) -> None:
    from toolkit.assets.padding import pad
    from toolkit.bench import BenchOptions, bench
    from toolkit.core.errors import ToolkitError
    from toolkit.eval_tau import eval_tau
    from toolkit.quant import quantize

    out = run.path.parent
    pt, pd = WORK / "pad" / "target", WORK / "pad" / "draft"
    run.step("pad", lambda: [str(pad(str(target), str(pt))), str(pad(str(draft), str(pd)))])
    held = draft / "heldout.json"
    kw = dict(heldout=str(held), block_sizes=[8, 16], max_new_tokens=128, backend="exllamav3", concurrency=24, quiet=True)
    run.step("tau_exl3_bf16", lambda: tau_only(eval_tau(str(pt), str(pd), out=str(WORK / "tau_exl3.json"), **kw)), need_s=30)
    prompts = heldout_jsonl(held, WORK / "heldout.jsonl")

    def run_bench() -> dict:
        r = bench(BenchOptions(target=str(pt), draft=str(pd), backend="exllamav3", prompts=str(prompts), block_sizes=[8, 16], concurrency=[1, 8],
                  max_new_tokens=128, limit=16, out=str(out / "bench"), quiet=True))
        return {"ar": r["ar"], "cells": [{k: c[k] for k in ("block_size", "concurrency", "tau", "tok_s", "ar_tok_s", "speedup", "lossless")
                                          if k in c} for c in r["cells"]]}

    run.step("bench_exl3", run_bench, need_s=40)
    q = WORK / "q"

    def run_quantize() -> dict:
        try:
            rep = quantize(recipe=str(RECIPE), model=str(pd), target=str(pt), out=str(q), also_uncalibrated=True, force=True,
                           progress=False)
            verdict = "pass"
        except ToolkitError as e:                       # below a threshold: the report is still written
            verdict = str(e)[:600]
            rep = json.loads((q / "report.json").read_text()) if (q / "report.json").is_file() else None
        for name in ("report.md", "report.json", "tau_top1.png"):
            if (q / name).is_file():
                shutil.copy(q / name, out / name)
        return {"verdict": verdict, "bf16_tau": (rep or {}).get("bf16", {}).get("tau"),
                "results": [{k: r.get(k) for k in ("folder", "bits", "calibrated", "size_bytes", "kl", "top1", "tau", "passed")}
                            for r in (rep or {}).get("results", [])]}

    qr = run.step("quantize", run_quantize, need_s=200)
    if qr:
        per: dict = {}
        run.results["tau_exl3_per_bitrate"] = per
        for r in qr["results"]:
            folder = q / r["folder"]
            res = run.step(f"tau_exl3_{r['folder']}", lambda f=folder: tau_only(eval_tau(str(pt), str(f), **kw)), need_s=15)
            if res:
                per[r["folder"]] = res["tau"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.smol_exl3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path(os.environ.get("SMOL_TARGET", WORK / "smollm2-135m-instruct")),
                    help="the prepared SmolLM2 target (default: SMOL_TARGET, else /tmp/smol-run/smollm2-135m-instruct)")
    ap.add_argument("--draft", type=Path, default=Path(os.environ.get("SMOL_DRAFT", WORK / "smollm2_dflash")),
                    help="the trained drafter (default: SMOL_DRAFT, else /tmp/smol-run/smollm2_dflash)")
    ap.add_argument("--budget-s", type=float, default=env_float("SMOL3_BUDGET_S", 560),
                    help="start no stage that does not fit in what is left of it (default: SMOL3_BUDGET_S, else 560)")
    a = ap.parse_args(argv)
    run = Run("exl3.json", budget_s=a.budget_s, section="stages")
    run.results.update(device=device_name(), inputs={"target": str(a.target), "draft": str(a.draft)})
    missing = [p for p in (a.target, a.draft) if not (p / "config.json").is_file()]
    if missing:
        run.errors["inputs"] = f"{missing[0]} is missing: run python -m experiments.smol_device run first, on this warm machine"
        return run.finish()
    measure(run, a.target, a.draft)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
