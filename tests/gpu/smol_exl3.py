"""The SmolLM2 pair on exllamav3 (issue 8, device call 3): tau per backend, speedup vs AR, tau per EXL3 bitrate.

Runs right after `tests/gpu/smol_device.py run` on the same warm machine (inside its 30 s idle window), reading the
prepared target and the freshly trained drafter from /tmp/smol-run (or SMOL_TARGET / SMOL_DRAFT):

    source .device/on-device.sh && python3 tests/gpu/smol_exl3.py        (carry [".device"]; writes $OUT/exl3.json)

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

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
T0 = time.time()
BUDGET = float(os.environ.get("SMOL3_BUDGET_S", 560))
OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/smol-run")
TARGET = Path(os.environ.get("SMOL_TARGET", WORK / "smollm2-135m-instruct"))
DRAFT = Path(os.environ.get("SMOL_DRAFT", WORK / "smollm2_dflash"))
RECIPE = ROOT / "quantize" / "smollm2-135m-dflash.toml"
RESULTS: dict = {"stages": {}, "errors": {}}


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save() -> None:
    RESULTS["elapsed_s"] = round(time.time() - T0, 1)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ".exl3.json.tmp").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")
    os.replace(OUT / ".exl3.json.tmp", OUT / "exl3.json")


def stage(name: str, fn, need_s: float = 0):
    left = BUDGET - (time.time() - T0)
    if left < need_s:
        RESULTS["errors"][name] = f"skipped: {left:.0f} s left, needs about {need_s:.0f}"
        log("SKIP", name)
        save()
        return None
    log("begin", name)
    t = time.time()
    try:
        out = fn()
        RESULTS["stages"][name] = {"seconds": round(time.time() - t, 1), "result": out}
        log("ok", name, json.dumps(out, default=str)[:600])
        return out
    except BaseException as e:
        RESULTS["errors"][name] = "".join(traceback.format_exception(e))[-3000:]
        log("FAILED", name, repr(e)[:400])
        return None
    finally:
        save()


def tau_only(res: dict) -> dict:
    return {"tau": res["tau"], "prompts": res["prompts"], "complete": res["complete"],
            "accept_16": {c: d.get("16", {}).get("accept_per_position", [])[:4] for c, d in res["detail"].items()}}


def heldout_jsonl(src: Path, dst: Path) -> Path:
    held = json.loads(src.read_text())
    dst.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for c, ps in held.items() for p in ps))
    return dst


def main() -> None:
    import torch

    from toolkit.bench import bench
    from toolkit.core.errors import ToolkitError
    from toolkit.eval_tau import eval_tau
    from toolkit.assets.padding import pad
    from toolkit.quant import quantize

    RESULTS["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    RESULTS["inputs"] = {"target": str(TARGET), "draft": str(DRAFT)}
    for p in (TARGET, DRAFT):
        if not (p / "config.json").is_file():
            RESULTS["errors"]["inputs"] = f"{p} is missing: run tests/gpu/smol_device.py run first, on this warm machine"
            save()
            return
    pt, pd = WORK / "pad" / "target", WORK / "pad" / "draft"
    stage("pad", lambda: [str(pad(str(TARGET), str(pt))), str(pad(str(DRAFT), str(pd)))])
    held = DRAFT / "heldout.json"
    kw = dict(heldout=str(held), block_sizes=[8, 16], max_new_tokens=128, backend="exllamav3", concurrency=24, quiet=True)
    stage("tau_exl3_bf16", lambda: tau_only(eval_tau(str(pt), str(pd), out=str(WORK / "tau_exl3.json"), **kw)), 30)
    prompts = heldout_jsonl(held, WORK / "heldout.jsonl")

    def run_bench() -> dict:
        r = bench(str(pt), str(pd), backend="exllamav3", prompts=str(prompts), block_sizes=[8, 16], concurrency=[1, 8],
                  max_new_tokens=128, limit=16, out=str(OUT / "bench"), quiet=True)
        return {"ar": r["ar"], "cells": [{k: c[k] for k in ("block_size", "concurrency", "tau", "tok_s", "ar_tok_s", "speedup", "lossless")
                                          if k in c} for c in r["cells"]]}

    stage("bench_exl3", run_bench, 40)
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
                shutil.copy(q / name, OUT / name)
        return {"verdict": verdict, "bf16_tau": (rep or {}).get("bf16", {}).get("tau"),
                "results": [{k: r.get(k) for k in ("folder", "bits", "calibrated", "size_bytes", "kl", "top1", "tau", "passed")}
                            for r in (rep or {}).get("results", [])]}

    qr = stage("quantize", run_quantize, 200)
    if qr:
        per: dict = {}
        RESULTS["tau_exl3_per_bitrate"] = per
        for r in qr["results"]:
            folder = q / r["folder"]
            res = stage(f"tau_exl3_{r['folder']}", lambda f=folder: tau_only(eval_tau(str(pt), str(f), **kw)), 15)
            if res:
                per[r["folder"]] = res["tau"]
    save()
    log("done")


if __name__ == "__main__":
    main()
