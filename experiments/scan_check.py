"""Issue 17: the tap forward of an EXL3 target with runtime/exl3_taps.stateful_scan (a zero initial state handed to
exllamav3's gated delta rule, so the no-cache forward uses the kernel build a cached prefill already made) against
the forward as exllamav3 runs it, on a synthetic Qwen3.6-35B-A3B target cut to 4 layers (3 linear-attention
layers, 1 full), with Triton's cache empty at the start (a new TRITON_CACHE_DIR under --work).

The load builds the cached prefill's kernels, as in the quantize target step. Then one forward with the wrapper,
then one without (which builds the no-cache variant), each timed from cold; then both again, warm. Passes when the
greedy tokens and every tap are bitwise equal. One call, carry [".device"]:

    source .device/on-device.sh && timeout 300 python -m experiments.scan_check       # writes $OUT/scan_check.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from experiments.harness import Run
from experiments.head_check import small_shape

WORK = Path("/tmp/scan-check")


def forward(t, ids: list[int], layers: list[int], stateful: bool) -> tuple[float, object, dict]:
    import torch

    from toolkit.exl3 import taps as exl3_taps

    exl3_taps.STATEFUL_SCAN = stateful
    torch.cuda.synchronize()
    t0 = time.time()
    greedy, states = t.forward(ids, layers)
    torch.cuda.synchronize()
    return round(time.time() - t0, 3), greedy, states


def compare(work: Path, layers: int, tokens: int) -> dict:
    import torch

    from toolkit.exl3.taps import open_target
    from toolkit.synthetic.build import synth

    target = work / "target"
    if not (target / "config.json").is_file():
        synth(str(small_shape(layers, work / "shape")), 4.0, str(target), quiet=True)
    t0 = time.time()
    t = open_target(target, cache_tokens=1024, max_concurrency=1, max_chunk=256)
    out: dict = {"load_s": round(time.time() - t0, 1)}
    try:
        ids = torch.randint(10, t.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        taps = list(range(layers))
        runs = {}
        for name, stateful in (("stateful_cold", True), ("stateless_cold", False),
                               ("stateful_warm", True), ("stateless_warm", False)):
            runs[name] = forward(t, ids, taps, stateful)
        out["seconds"] = {k: v[0] for k, v in runs.items()}
        (_, g1, s1), (_, g0, s0) = runs["stateful_warm"], runs["stateless_warm"]
        out["greedy_equal"] = bool(torch.equal(g1, g0))
        out["taps_max_abs_diff"] = {L: float((s1[L].float() - s0[L].float()).abs().max()) for L in taps}
        out["taps_equal"] = all(torch.equal(s1[L], s0[L]) for L in taps)
        out["passed"] = out["greedy_equal"] and out["taps_equal"]
        return out
    finally:
        t.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.scan_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=WORK, help="scratch folder (default /tmp/scan-check)")
    p.add_argument("--layers", type=int, default=4, help="target layers kept (default 4)")
    p.add_argument("--tokens", type=int, default=160, help="prompt length of the forward (default 160)")
    p.add_argument("--budget-s", type=float, default=280.0)
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)           # cold: a new, empty kernel cache of this run's own
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-", dir=a.work)
    run = Run("scan_check.json", budget_s=a.budget_s)
    run.step("compare", compare, a.work, a.layers, a.tokens)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
