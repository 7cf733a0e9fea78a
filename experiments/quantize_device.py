"""Device run of toolkit.quant, end to end with the real exllamav3 converter; prints and writes JSON.

  source .device/on-device.sh && python -m experiments.quantize_device --out "$OUT"     (carry [".device"])

1. fixture: a tiny target + DFlash drafter trained on the GPU (hidden 128, a multiple of exllamav3's 128 tiles),
   converted at 2, 4 and 8 bits, calibrated and uncalibrated, checked (KL, top-1, τ, tap_shift).
2. real shape: a random drafter with the upstream drafter's shape (quantize/shapes/qwen3.6-35b-a3b-dflash.json:
   6 layers, hidden 2048, 5 sliding + 1 full, taps for 40 target layers), converted per bitrate uncalibrated,
   plus one calibrated with synthetic Hessians; timed.
Targets: top-1 at 8 bits >= 0.99 on the fixture; <= 120 s per bitrate for the real shape.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from experiments.harness import Run, device_name
from toolkit.core.errors import ToolkitError
from toolkit.quant import convert as conv
from toolkit.quant import QuantizeOptions, quantize

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "quantize" / "shapes"
CAL = ["Return the number of items in a container.", "Open the file and return a stream object.",
       "Split the string at the first occurrence of sep.", "Create a new dictionary with keys from iterable.",
       "Return a copy of the string with leading whitespace removed.", "Raise an error if the path does not exist.",
       "Parse command line options and return the namespace.", "Write the data to the socket and flush."]
HELD = ["Return True if the object is callable.", "Join the path components with the separator.",
        "Decode the bytes using the given codec.", "Start the thread and wait for it to finish."]
TIMES: list[dict] = []


def timed_converter():
    """Wrap the real run_converter (it still runs exllamav3) to record seconds per call."""
    real = conv.run_converter

    def run(args, log_path):
        t0 = time.time()
        rc = real(args, log_path)
        TIMES.append({"bits": float(args[args.index("-b") + 1]), "calibrated": "-hess" in args, "rc": rc,
                      "seconds": round(time.time() - t0, 1), "out": args[args.index("-o") + 1]})
        return rc

    conv.run_converter = run


def shape_config(name: str) -> dict:
    """A config of quantize/shapes without its `_source` note."""
    cfg = json.loads((SHAPES / name).read_text())
    cfg.pop("_source", None)
    return cfg


def write_recipe(path: Path, target: Path) -> Path:
    path.write_text(
        f'[model]\nid = "fixture/tiny-dflash-128"\n[target]\nid = "{target}"\n[bits]\ndefault = [2.0, 4.0, 8.0]\n'
        f'[calibration]\nanchors_per_prompt = 8\nprompts = {json.dumps(CAL)}\n'
        f'[check]\nmax_new_tokens = 48\ntap_shift_candidates = [0, 1, 2]\nprompts = {json.dumps(HELD)}\n'
        '[thresholds]\n"8.0" = { min_top1 = 0.99 }\n'
    )
    return path


def run_fixture(out: Path, bits: str, target_steps: int, draft_steps: int) -> dict:
    from experiments.pair128 import train_pair

    t0 = time.time()
    try:
        tdir, ddir, _ = train_pair(out / "fixture-models", target_steps=target_steps, draft_steps=draft_steps, sequences=256)
        trained = True
    except Exception as e:  # fall back to random weights: conversion still runs, quality targets are moot
        print(f"fixture training failed ({type(e).__name__}: {e}); using random weights", file=sys.stderr)
        from toolkit.assets.fixtures import build
        tdir, ddir = build(out / "fixture-models", arch="llama", block_size=16, hidden=128)
        trained = False
    res = {"trained": trained, "build_seconds": round(time.time() - t0, 1), "error": None}
    recipe = write_recipe(out / "fixture.toml", tdir)
    qout = out / "fixture-exl3"
    try:
        quantize(QuantizeOptions(recipe=str(recipe), model=str(ddir), bits=bits, out=str(qout), also_uncalibrated=True,
                                 device="cuda", force=True))
    except ToolkitError as e:
        res["error"] = str(e)
    rpath = qout / "report.json"
    if rpath.is_file():
        rep = json.loads(rpath.read_text())                 # brought back whole as fixture_report.json
        eight = [r for r in rep["results"] if r["bits"] == 8.0 and r["calibrated"]]
        res["top1_8bit"] = eight[0]["top1"] if eight else None
        res["top1_8bit_ok"] = bool(eight and eight[0]["top1"] is not None and eight[0]["top1"] >= 0.99)
        res["table"] = [{k: r[k] for k in ("folder", "bits", "calibrated", "size_bytes", "kl", "top1", "tau", "passed")}
                        for r in rep["results"]]
        res["bf16_tau"] = rep["bf16"]["tau"]
        res["tap_shift"] = rep["tap_shift"]
    res["conversions"] = [t for t in TIMES if "fixture" in t["out"]]
    return res


def real_shape(folder: Path) -> tuple[Path, Path]:
    """A random drafter of the upstream shape (weights std 0.02) and its target's config.json (no weights)."""
    from toolkit.dflash import save_drafter
    from toolkit.assets.fixtures import random_drafter

    ddir, tdir = folder / "draft", folder / "target"
    save_drafter(random_drafter(shape_config("qwen3.6-35b-a3b-dflash.json"), seed=0, std=0.02), ddir, dtype=torch.bfloat16)
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "config.json").write_text(json.dumps(shape_config("qwen3.6-35b-a3b.json"), indent=2) + "\n")
    return ddir, tdir


def synthetic_hessians(model_dir: Path, out: Path) -> Path:
    """Hessians of random correlated activations (XᵀX/n), one per Linear: times the calibrated path."""
    from toolkit.dflash import DFlashConfig
    from toolkit.quant.calibrate import write_hessians
    from toolkit.quant.validate import expected_shapes, linear_keys

    cfg = DFlashConfig.from_dir(model_dir)
    shapes = expected_shapes(cfg)
    hs = {}
    for k in linear_keys(cfg):
        n = shapes[k + ".weight"][1]
        x = torch.randn(4096, n, device="cuda") @ (torch.eye(n, device="cuda") + 0.05 * torch.randn(n, n, device="cuda"))
        hs[k] = (x.T @ x / x.shape[0]).cpu()
    return write_hessians(hs, out)


def run_real(out: Path, bits: str, cal_bits: str) -> dict:
    from toolkit.quant.plan import PlanItem
    from toolkit.quant.validate import read_headers, unquantized_keys, validate

    d = shape_config("qwen3.6-35b-a3b-dflash.json")
    res = {"shape": f"{d['num_hidden_layers']} layers, hidden {d['hidden_size']}, layer types {d['layer_types']}, "
                    f"taps {d['dflash_config']['target_layer_ids']} of {d['num_target_layers']}", "error": None}
    t0 = time.time()
    ddir, tdir = real_shape(out / "real-models")
    res["build_seconds"] = round(time.time() - t0, 1)
    qout = out / "real-exl3"
    try:
        quantize(QuantizeOptions(model=str(ddir), target=str(tdir), bits=bits, out=str(qout), calibrate=False,
                                 check=False, force=True, device="cuda"))
    except ToolkitError as e:
        res["error"] = str(e)
    if cal_bits:
        checked = validate(ddir)
        hess = synthetic_hessians(ddir, out / "real-hessians")
        for b in [float(x) for x in cal_bits.split(",")]:
            item = PlanItem(b, True, f"{b:.1f}bpw-synthcal", f"{b:.1f}bpw-synthcal", 0)
            try:
                conv.convert_bitrate(item, ddir, qout, qout / ".work", read_headers(ddir)[0], unquantized_keys(checked.config),
                                     "real-shape", None, 1, hessians=hess, device="cuda")
            except ToolkitError as e:
                res["error"] = (res["error"] or "") + f" | synthcal {b}: {e}"
    res["conversions"] = [t for t in TIMES if "real" in t["out"]]
    res["sizes"] = {p.name: conv.folder_size(p) for p in sorted(qout.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    res["max_seconds"] = max((t["seconds"] for t in res["conversions"]), default=None)
    res["within_2_min"] = res["max_seconds"] is not None and res["max_seconds"] <= 120
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.quantize_device", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for outputs and quantize_device.json")
    ap.add_argument("--fixture-bits", default="2,4,8")
    ap.add_argument("--target-steps", type=int, default=800)
    ap.add_argument("--draft-steps", type=int, default=2500)
    ap.add_argument("--real-bits", default="3,4,5,6,8", help="bitrates to time on the real shape ('' to skip)")
    ap.add_argument("--real-calibrated-bits", default="4", help="bitrates to time with synthetic Hessians ('' to skip)")
    ap.add_argument("--skip-fixture", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    work = Path("/tmp/quantize_device")
    work.mkdir(parents=True, exist_ok=True)
    timed_converter()
    run = Run("quantize_device.json", out=out)
    run.results.update(device=device_name(), torch=torch.__version__)
    if not a.skip_fixture:
        run.step("fixture", run_fixture, work, a.fixture_bits, a.target_steps, a.draft_steps)
    if a.real_bits:
        run.step("real_shape", run_real, work, a.real_bits, a.real_calibrated_bits)
    for f in ("report.json", "report.md", "tau_top1.png"):
        if (work / "fixture-exl3" / f).exists():
            shutil.copy(work / "fixture-exl3" / f, out / f"fixture_{f}")
    for log in list((work / "fixture-exl3" / ".work").glob("*.log"))[:8] + list((work / "real-exl3" / ".work").glob("*.log"))[:8]:
        shutil.copy(log, out / f"{log.parent.parent.name}_{log.name}")
    run.finish()
    print(json.dumps(run.results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
