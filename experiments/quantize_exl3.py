"""toolkit.quantize with an EXL3 target on the device: the full Qwen3.6-35B-A3B recipe on the real shape,
timed end to end with its peak GPU memory, and the SmolLM2 pair for real τ per bitrate on exllamav3.

`shape` on a fresh machine takes two calls, each inside the device's 600 s per command (carry [".device"] both):

    # call 1: on-device.sh installs exllamav3 (~100 s on a fresh machine), then the synthesis (~20 s), and stop
    source .device/on-device.sh && timeout $((595 - SECONDS)) python -m experiments.quantize_exl3 shape --stage
    # or, for a run with Triton's kernel cache warm (a machine that served the target before): also the target
    # step's exllamav3 work once (~150 s; 2026-12-04's profile: ~100 s of a cold target step is Triton compiling)
    source .device/on-device.sh && timeout $((595 - SECONDS)) python -m experiments.quantize_exl3 shape --stage --warm
    # call 2, the same warm machine: /tmp/q36 is reused (no synthesis), the recipe runs: 554.5 s after a cold
    # call 1 (2026-12-05, H100: target 107, calibrate 8, convert 248, check 27, speed 143), less after `--warm`
    # (about 95 s of the cold target step is Triton compiling)
    source .device/on-device.sh && timeout $((595 - SECONDS)) python -m experiments.quantize_exl3 shape

`$((595 - SECONDS))` gives python what on-device.sh left of the call (bash's SECONDS counts from the call's start),
so timeout's SIGTERM comes ~5 s before the device's hard limit: the handler saves the results with the quantize
step it cut at once (recorded on 2026-12-04), which those seconds allow. Without `--stage` a call synthesises whatever /tmp/q36 lacks and then runs the
recipe; one call of both fits only when the install is quick (the run of 2026-12-03 19:19 was cut in `speed`).

    # after `python3 -m experiments.smol_device stage` on the same warm machine
    source .device/on-device.sh && timeout $((595 - SECONDS)) python -m experiments.quantize_exl3 pair

`shape`: (1) `--stage` (or whatever is missing): toolkit.synthetic.synth writes a 4.0 bpw EXL3 target of
quantize/shapes/qwen3.6-35b-a3b.json (about 18.4 GB, ~20 s) and a BF16 drafter of
quantize/shapes/qwen3.6-35b-a3b-dflash.json with random weights (toolkit.assets.fixtures.random_drafter, std 0.02,
plus a README.md and LICENSE so that OUT/upstream is made) into /tmp/q36 (`--work`), each skipped when its
config.json is there; (2) `python -m toolkit.quantize --recipe quantize/qwen3.6-35b-a3b-dflash.toml --model DRAFT
--target TARGET --out /tmp/q36/out --force`: 5 bitrates, calibrated, KL/top-1, τ and speed per bitrate on
exllamav3 (one target load, the drafters swapped in), report and cards, timed end to end (target: <= 10 minutes,
peak <= 22 GiB). Random weights: the numbers mean nothing (the thresholds fail and say so), the plumbing, the
time and the memory are real.

`pair`: the SmolLM2 pair. `python3 -m experiments.smol_device stage` first prepares the target in
/tmp/smol-run/smollm2-135m-instruct (same warm machine); here the target and the shipped drafter
(toolkit/data/smollm2_dflash) are padded to hidden 768 (exllamav3 1.6.5 needs 128-aligned widths), the padded
target is converted to EXL3 4.0 bpw (exllamav3's converter), and toolkit.quantize runs
quantize/smollm2-135m-dflash.toml against it with --also-uncalibrated: τ per bitrate on exllamav3, calibrated vs
uncalibrated, with the BF16 drafter as reference.

Writes $OUT/quantize_exl3.json: per harness step seconds, result, errors; `quantize_steps`, each quantize step's
seconds and peak GPU memory (GiB: torch's peak, the device's, the plan's estimate; the target step's `phases` the
same per phase: load, continue, forward, parts) saved as the step ends, and
`quantize_progress` (the last step done, the one running, the peak so far; `cut_off` when a SIGTERM stopped it),
so a call cut off at its limit still returns its step table; and $OUT/<mode>/ (report.json, report.md,
tau_top1.png, cards.tar.gz with every card) once quantize ends: 5 files, as $OUT takes back 8.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from experiments.harness import Run, convert_exl3, device_name, env_float, free_cuda

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "quantize" / "shapes"
SHAPE_RECIPE = ROOT / "quantize" / "qwen3.6-35b-a3b-dflash.toml"
Q36 = Path("/tmp/q36")
SMOL = Path("/tmp/smol-run")
GIB = 1024**3


def shape_config(name: str) -> dict:
    cfg = json.loads((SHAPES / name).read_text())
    cfg.pop("_source", None)
    return cfg


def stage_shape(work: Path) -> dict:
    """The synthetic 4.0 bpw target and the random upstream-shaped BF16 drafter (skipped when already there)."""
    import torch

    from toolkit.assets.fixtures import random_drafter
    from toolkit.dflash import save_drafter
    from toolkit.synthetic.build import synth

    out: dict = {}
    target, draft = work / "target-4.0", work / "draft"
    if not (target / "config.json").is_file():
        out["target"] = {k: v for k, v in synth(str(SHAPES / "qwen3.6-35b-a3b.json"), 4.0, str(target), quiet=True).items()
                         if k in ("bytes", "size", "shards", "seconds")}
    if not (draft / "config.json").is_file():
        t = time.time()
        model = random_drafter(shape_config("qwen3.6-35b-a3b-dflash.json"), seed=0, std=0.02)
        save_drafter(model, draft, dtype=torch.bfloat16, extra_files={
            "README.md": "---\nlicense: mit\n---\n# Random drafter\n\nUpstream-shaped stand-in with random weights.\n",
            "LICENSE": "MIT License (stand-in for the upstream license file)\n"})
        out["draft"] = {"seconds": round(time.time() - t, 1)}
    out["bytes"] = {p.name: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (target, draft)}
    return out


def triton_files(cache: Path) -> int:
    """Files in Triton's kernel cache: how warm the run that follows found it."""
    return sum(1 for f in cache.rglob("*") if f.is_file()) if cache.is_dir() else 0


def warm_kernels(target: Path, draft: Path, recipe: Path) -> dict:
    """The target step's exllamav3 work once, on token ids of the recipe's prompt count and lengths: the load, the
    greedy continuations, the tap forwards; Triton compiles and autotunes the kernels they use into its cache
    (TRITON_CACHE_DIR), as a machine that served the target once has them. Measured on 2026-12-04: 109 s of the
    cold target step's 152 s (under py-spy) were that compilation, paid once per machine."""
    import random

    from toolkit.dflash import DFlashConfig
    from toolkit.quant import engine, memory as mem
    from toolkit.quant.recipe import load_recipe
    from toolkit.quant.target import exl3_opener, exl3_target, target_shifts

    r = load_recipe(recipe)
    config = DFlashConfig.from_dir(draft)
    tcfg = json.loads((target / "config.json").read_text())
    shifts = target_shifts(r.tap_shift_candidates, config, tcfg)
    rng, vocab = random.Random(0), mem.target_text(tcfg).get("vocab_size", 1000)
    ids = lambda n: [[rng.randrange(10, vocab) for _ in range(rng.randint(20, 40))] for _ in range(n)]  # noqa: E731
    cal, held = ids(len(r.calibration_prompts)), ids(len(r.check_prompts))
    phases, cache = mem.Phases(), Path(os.environ["TRITON_CACHE_DIR"])
    before = triton_files(cache)
    exl3_target(exl3_opener(engine.ENGINE.open_target, target, cal + held, r.max_new_tokens), cal, held, config,
                shifts, r.max_new_tokens, phases.phase)
    return {"phases": {p["phase"]: round(p["seconds"], 1) for p in phases.rows},
            "triton_files": {"before": before, "after": triton_files(cache)}}


def quantize_run(recipe: Path, model: Path, target: Path, out: Path, keep: Path, extra: list[str],
                 on_step: Callable[[dict], None] | None = None) -> dict:
    """python -m toolkit.quantize ... --force, timed end to end; the report, card and verdict kept under `keep`;
    `on_step` gets each quantize step's row as it ends (recorder)."""
    from toolkit.core.errors import ToolkitError
    from toolkit.quantize import main

    t = time.time()
    try:
        main(["--recipe", str(recipe), "--model", str(model), "--target", str(target), "--out", str(out), "--force",
              *extra], on_step=on_step)
        verdict = "pass"
    except ToolkitError as e:                    # below a threshold: report and cards are still written
        verdict = str(e)[:800]
    wall = round(time.time() - t, 1)
    keep.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "report.md", "tau_top1.png"):
        if (out / name).is_file():
            shutil.copy(out / name, keep / name)
    cards = sorted(out.glob("*/README.md"))
    if cards:                                    # one archive: $OUT takes back 8 files (the pair has 13 cards)
        with tarfile.open(keep / "cards.tar.gz", "w:gz") as tar:
            for card in cards:
                tar.add(card, arcname=f"card-{card.parent.name}.md")
    rep = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return {"verdict": verdict, "wall_seconds": wall, "upstream": sorted(p.name for p in (out / "upstream").glob("*")),
            **summary(rep)}


def gib(v: int | None) -> float | None:
    return None if v is None else round(v / GIB, 2)


def step_row(s: dict) -> dict:
    """One quantize step (a row of report.json's `steps`) in GiB: seconds, torch's and the device's peak, the plan's;
    and its phases' (the target step's load, continue, forward, parts), when it measured some."""
    phases = [{"phase": p["phase"], "seconds": p["seconds"], "peak_allocated_gib": gib(p["peak_allocated_bytes"]),
               "peak_device_gib": gib(p["peak_device_bytes"])} for p in s.get("phases") or []]
    return {"step": s["step"], "seconds": s["seconds"], "peak_allocated_gib": gib(s.get("peak_allocated_bytes")),
            "peak_device_gib": gib(s.get("peak_device_bytes")), "estimated_gib": gib(s.get("estimated_bytes")),
            **({"phases": phases} if phases else {})}


def recorder(run: Run) -> Callable[[dict], None]:
    """toolkit.quantize's on_step: each step's row into results["quantize_steps"] and results["quantize_progress"]
    (the step that runs next, the peaks so far), saved at once, so a call cut off later still returns them."""
    from toolkit.quant.run import STEPS

    rows: list[dict] = []
    run.results.update(quantize_steps=rows, quantize_progress={"done": None, "running": STEPS[0]})
    t0 = time.time()

    def on_step(row: dict) -> None:
        rows.append(step_row(row))
        i = STEPS.index(row["step"])
        top = lambda k: max((r[k] for r in rows if r[k] is not None), default=None)      # noqa: E731
        run.results["quantize_progress"] = {
            "done": row["step"], "running": STEPS[i + 1] if i + 1 < len(STEPS) else None,
            "seconds": round(time.time() - t0, 1), "steps_seconds": round(sum(r["seconds"] for r in rows), 1),
            "peak_allocated_gib": top("peak_allocated_gib"), "peak_device_gib": top("peak_device_gib")}
        run.log("quantize step", row["step"], f"{row['seconds']}s")
        run.save()

    return on_step


def stop_on_sigterm(run: Run):
    """timeout's SIGTERM becomes a SystemExit that the harness records as the running step's failure, with the
    quantize step it cut in results["quantize_progress"]["cut_off"], saved here first: the record survives cleanup
    that outlives the seconds before the hard kill, or code that swallows the exit; returns the handler it replaced."""
    def stop(signum, frame):
        prog = run.results.get("quantize_progress")
        if prog is not None:
            prog["cut_off"] = {"signal": "SIGTERM", "at_s": round(run.elapsed(), 1), "in_step": prog.get("running")}
        run.save()
        raise SystemExit(f"SIGTERM at {run.elapsed():.0f} s"
                         + (f", in quantize step {prog.get('running')}" if prog is not None else ""))

    return signal.signal(signal.SIGTERM, stop)


def summary(rep: dict) -> dict:
    """What the results page needs from a report: time and memory per step, τ and speed per bitrate."""
    if not rep:
        return {}
    return {
        "memory_gib": {k: gib(v) if k.endswith("bytes") else v for k, v in (rep.get("memory") or {}).items()},
        "steps": [step_row(s) for s in rep.get("steps") or []],
        "recommended_draft_tokens": rep.get("recommended_draft_tokens"),
        "widths": [{k: c.get(k) for k in ("draft_tokens", "tau", "tok_s", "ar_tok_s", "speedup", "lossless")}
                   for c in rep.get("exl3_widths") or []],
        "bf16": {"tau": (rep["bf16"].get("exl3") or {}).get("tau"), "speedup": (rep["bf16"].get("exl3") or {}).get("speedup")},
        "results": [{"folder": r["folder"], "calibrated": r["calibrated"], "kl": r["kl"], "top1": r["top1"],
                     "passed": r["passed"], **{k: (r.get("exl3") or {}).get(k)
                                               for k in ("tau", "tok_s", "speedup", "lossless", "accept_per_position")}}
                    for r in rep.get("results") or []],
    }


def run_shape(run: Run, a) -> None:
    staged = run.step("stage", stage_shape, a.work, need_s=60)
    if staged is None:
        return
    if a.warm:
        run.step("warm", warm_kernels, a.work / "target-4.0", a.work / "draft", SHAPE_RECIPE, need_s=200)
    if a.stage:
        return
    free_cuda()
    run.results["triton_files_before_quantize"] = triton_files(Path(os.environ["TRITON_CACHE_DIR"]))
    run.step("quantize", quantize_run, SHAPE_RECIPE, a.work / "draft", a.work / "target-4.0", a.work / "out",
             run.path.parent / "shape", ["--bits", a.bits] if a.bits else [], recorder(run), need_s=120)


def stage_pair(work: Path, target: Path, draft: Path) -> dict:
    """Both padded to hidden 768, the padded target converted to EXL3 4.0 bpw (its tokenizer files copied along)."""
    from toolkit.assets.padding import pad

    pt, pd, te = work / "pad" / "target", work / "pad" / "draft", work / "target-exl3-4.0"
    for src, dst in ((target, pt), (draft, pd)):
        if not (dst / "config.json").is_file():
            pad(str(src), str(dst))
    conv = None
    if not (te / "config.json").is_file():
        conv = convert_exl3(pt, te, 4.0, work / "work-target")
        for f in pt.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and not (te / f.name).exists():
                shutil.copy(f, te / f.name)
    return {"padded": [str(pt), str(pd)], "target": str(te), "convert": conv}


def run_pair(run: Run, a) -> None:
    target, draft = a.smol_target, a.smol_draft
    missing = [p for p in (target, draft) if not (p / "config.json").is_file()]
    if missing:
        run.errors["inputs"] = f"{missing[0]} is missing: run python3 -m experiments.smol_device stage first, on this warm machine"
        return
    staged = run.step("stage", stage_pair, a.work, target, draft, need_s=60)
    if staged is None:
        return
    run.step("quantize", quantize_run, ROOT / "quantize" / "smollm2-135m-dflash.toml", Path(staged["padded"][1]),
             Path(staged["target"]), a.work / "out", run.path.parent / "pair", ["--also-uncalibrated"], recorder(run),
             need_s=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.quantize_exl3", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("shape", "pair"), help="shape: the Qwen3.6 recipe on synthetic weights; pair: SmolLM2")
    ap.add_argument("--stage", action="store_true", help="shape: only write the synthetic target and drafter into "
                    "--work (call 1 of two on a fresh machine; call 2, without it, reuses them)")
    ap.add_argument("--warm", action="store_true", help="shape: after staging, run the target step's exllamav3 "
                    "work once so that Triton's kernel cache (TRITON_CACHE_DIR, default WORK/triton) is warm for the "
                    "next call, as on a machine that served the target before (~100 s of compilation on a fresh one)")
    ap.add_argument("--bits", default=None, help="shape: the bitrates to convert (toolkit.quantize --bits, e.g. 4.0 "
                    "for a profile of one bitrate; default: the recipe's five)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default /tmp/q36, or /tmp/smol-run/q for pair)")
    ap.add_argument("--smol-target", type=Path, default=Path(os.environ.get("SMOL_TARGET", SMOL / "smollm2-135m-instruct")),
                    help="pair: the prepared SmolLM2 target (default SMOL_TARGET, else /tmp/smol-run/smollm2-135m-instruct)")
    ap.add_argument("--smol-draft", type=Path, default=ROOT / "toolkit" / "data" / "smollm2_dflash",
                    help="pair: the drafter (default: the shipped toolkit/data/smollm2_dflash)")
    ap.add_argument("--budget-s", type=float, default=env_float("QEXL3_BUDGET_S", 580),
                    help="start no step that does not fit in what is left of it (default QEXL3_BUDGET_S, else 580)")
    a = ap.parse_args(argv)
    a.work = a.work or (Q36 if a.mode == "shape" else SMOL / "q")
    # Triton's kernel cache under --work: /tmp outlives a call on a warm machine, so call 1's --warm serves call 2
    os.environ.setdefault("TRITON_CACHE_DIR", str(a.work / "triton"))
    run = Run("quantize_exl3.json", budget_s=a.budget_s, section="steps")
    run.results.update(mode=a.mode, device=device_name(), work=str(a.work))
    before = stop_on_sigterm(run)
    try:
        (run_shape if a.mode == "shape" else run_pair)(run, a)
    finally:
        signal.signal(signal.SIGTERM, before)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
