"""The one harness the device experiments share: timestamped logs, a wall-clock budget, results written to $OUT
as JSON after every step, per-step error capture, and the staging helpers several scripts need.

A device call is cut off at its time limit and returns only what lies under $OUT, so a script records each step
as it finishes and stops starting new ones when its budget runs out; a failing step leaves its traceback in the
results and the run goes on with the next one.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# pip download flags for the device's interpreter (CPython 3.12, manylinux x86_64): the device has no network
DEVICE_WHEEL_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                         "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                         "--platform", "manylinux2014_x86_64"]


def out_dir() -> Path:
    """$OUT: the folder a device call brings back (default /tmp/out)."""
    return Path(os.environ.get("OUT", "/tmp/out"))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def tail(e: BaseException, chars: int = 3000) -> str:
    """The end of an exception's traceback, as results keep it."""
    return "".join(traceback.format_exception(e))[-chars:]


class Run:
    """One experiment run: `results` is saved to `out/file` (atomically) after every step.

    Step results go under `results[section][name]` as {"seconds", "result"}; failures and skips under
    `results["errors"][name]`."""

    def __init__(self, file: str, budget_s: float = math.inf, section: str = "steps", out: Path | None = None):
        self.path = (out or out_dir()) / file
        self.budget_s, self.section, self.t0 = budget_s, section, time.time()
        self.results: dict[str, Any] = {section: {}, "errors": {}}

    @property
    def steps(self) -> dict:
        return self.results[self.section]

    @property
    def errors(self) -> dict:
        return self.results["errors"]

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def log(self, *a) -> None:
        print(f"[{self.elapsed():6.1f}s]", *a, flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def fail(self, name: str, e: BaseException) -> None:
        """Record a failed step's traceback under errors, and save."""
        self.errors[name] = tail(e)
        self.log("FAILED", name, repr(e)[:400])
        self.save()

    def skip(self, name: str, why: str) -> None:
        self.errors[name] = f"skipped: {why}"
        self.log("SKIP", name, why)
        self.save()

    def step(self, name: str, fn: Callable, *a, need_s: float = 0.0, keep: bool = True, **k):
        """Run fn(*a, **k) as one step: skipped when less than need_s of the budget is left, its result kept
        (keep=False for live objects such as a loaded backend), an exception recorded; returns None then."""
        if self.left() < need_s:
            self.skip(name, f"{self.left():.0f} s of budget left, needs about {need_s:.0f} s")
            return None
        self.log("begin", name)
        t = time.time()
        try:
            out = fn(*a, **k)
        except (Exception, SystemExit) as e:        # a library's sys.exit is a failed step too, not the end of the run
            self.fail(name, e)
            return None
        secs = round(time.time() - t, 1)
        if keep:
            self.steps[name] = {"seconds": secs, "result": out}
        self.log("ok", name, f"{secs}s", json.dumps(out, default=str)[:500] if keep else "")
        self.save()
        return out

    def finish(self) -> int:
        """Save the final results; the exit status is 1 when any step failed or was skipped."""
        self.results["seconds"] = round(self.elapsed(), 1)
        self.save()
        self.log("done; errors:", list(self.errors) or "none")
        return 1 if self.errors else 0



def warm_up(run: Run, out: dict, passes: int, one_pass: Callable[[int], object]) -> None:
    """one_pass(i) for i < passes, untimed, before the repetitions: a process's first pass meets every shape cold
    (64 s against ~8 s later on an H100) and Repetitions sizes the budget by its longest repetition.
    Their seconds go to out["warmup_seconds"]."""
    for i in range(passes):
        t0 = time.time()
        one_pass(i)
        out.setdefault("warmup_seconds", []).append(round(time.time() - t0, 1))
        run.log(f"warm-up pass {i + 1}: {out['warmup_seconds'][-1]:.0f} s (untimed)")


class Repetitions:
    """Interleaved repetitions inside a Run's budget: none starts unless the longest so far (+10 %) still fits with
    `reserve_s` to spare. Iterate for the repetition index; `lap()` at the end of one gives the longest so far."""

    def __init__(self, run: Run, reps: int, reserve_s: float):
        self.run, self.reps, self.reserve_s = run, reps, reserve_s
        self.seconds, self._t0 = 0.0, 0.0

    def __iter__(self):
        for rep in range(self.reps):
            if rep and self.run.left() < self.seconds * 1.1 + self.reserve_s:
                self.run.log(f"stopping after {rep} repetitions: {self.run.left():.0f} s left, a repetition takes "
                             f"{self.seconds:.0f} s")
                return
            self._t0 = time.time()
            yield rep

    def lap(self) -> float:
        self.seconds = max(self.seconds, time.time() - self._t0)
        return self.seconds

# -- staging helpers -----------------------------------------------------------------------------------


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def free_cuda(*backends) -> None:
    """Close backends (their models unload) and give the cached GPU memory back."""
    import torch

    for be in backends:
        if be is not None:
            be.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def convert_exl3(src: Path, dst: Path, bits: float, work: Path | None = None, timeout: float | None = None) -> dict:
    """exllamav3's own converter on an HF folder; RuntimeError with the end of its output when it fails."""
    t = time.time()
    work = work or dst.with_name(f"work-{dst.name}")
    p = subprocess.run([sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(dst),
                        "-w", str(work), "-b", str(bits)], capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"convert {src.name} at {bits} bits failed: {(p.stdout + p.stderr)[-1500:]}")
    return {"seconds": round(time.time() - t, 1), "bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors"))}


def download_wheels(dest: Path, specs: list[str]) -> list[Path]:
    """Here, with PyPI: wheels for the device's Python (no dependencies resolved) into a temporary folder `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *DEVICE_WHEEL_PLATFORM, "-d", str(dest),
                    *specs], check=True)
    return sorted(dest.glob("*.whl"))
