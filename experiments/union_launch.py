"""How exllamav3's multi-matrix EXL3 GEMM is launched, and what that does to the union MoE path's speed.

The union path (toolkit/moe/union.py) calls `exl3_mgemm` over every slot of a call (2u matrices for gate+up, u for
down). exllamav3 either tunes that launch (our default: force_shape -1, force_num_sms 0; its tuner times SMs per
matrix against matrices in flight) or, when a shape or an SM count is forced, takes its own heuristic (one SM per
matrix while the slots outnumber the SMs). This times one eager union forward per variant at each row count on
the one-layer cut of the target that experiments/moe_paths.py synthesises (reused when present), interleaved,
beside the bytes-over-bandwidth bound of the experts the call touches, and checks each variant's output against
the tuned one. Every call is synchronised and named on stdout first, so a stall names its variant. The timing is
of eager forwards, Triton's host launches included: at 1-16 rows on an H100 those bind (about 0.27 ms a call at
any row count), so rank the kernels with `moe_paths --steps profile` instead.

    source .device/on-device.sh && timeout 300 python -m experiments.union_launch     (carry [".device"])

Writes $OUT/union_launch.json (default /tmp/out).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from experiments.harness import Run, device_name
from experiments.moe_paths import LAYERS, WORK, bandwidth, expert_bytes, hidden_rows, load_layer, route, synth_layer, \
    synced, timed

# (force_shape_idx, force_num_sms) per variant: exllamav3 tunes only when neither is forced
VARIANTS = {"tuned": (-1, 0), "heuristic": (-1, 1), "shape1": (1, 1), "shape2": (2, 1), "shape3": (3, 1),
            "shape4": (4, 1)}


def launcher(mgemm, shape: int, sms: int):
    """exl3_mgemm with the union path's arguments but this launch choice."""
    return lambda *a: mgemm(*a[:9], shape, *a[10:14], sms)


def measure(moe, rows_list, reps: int, calls: int, run: Run) -> dict:
    import torch

    from toolkit.exl3 import seams
    from toolkit.exl3.moe import build, module_layer
    from toolkit.moe.union import union_forward

    tables = build("union", module_layer(moe), torch.device("cuda:0"))
    mgemm = seams.get("exl3_mgemm")
    (routed, shared, _), bw = expert_bytes(moe), bandwidth(device_name())
    fns, out = {}, {}
    for rows in rows_list:
        x = hidden_rows(moe, rows, seed=200 + rows).view(rows, -1)
        sel, w = route(moe, x)
        coded = int(sel.unique().numel()) * routed + shared
        cell = out[rows] = {"distinct_experts": int(sel.unique().numel()), "bytes": coded,
                            "bound_ms": round(coded / bw * 1e3, 4) if bw else None}
        ref = None
        for name, (shape, sms) in VARIANTS.items():
            f = (lambda m: lambda: union_forward(x, sel, w, tables, m))(launcher(mgemm, shape, sms))
            try:
                y = synced(f"{rows} rows, {name} (first call)", f, "launch")
                synced(f"{rows} rows, {name} (second call)", f, "launch")
            except Exception as e:                      # a shape exllamav3 refuses here
                cell[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            ref = y if ref is None else ref
            cell[name] = {"vs_tuned": float((y - ref).abs().max())}
            fns[(rows, name)] = f
    samples = {k: [] for k in fns}
    for rep in range(reps):
        if rep >= 3 and run.left() < 20:
            break
        for k, f in fns.items():
            samples[k].append(timed(f, calls)[0])
    for (rows, name), xs in samples.items():
        ms = statistics.median(xs)
        c = out[rows][name]
        c.update(gpu_ms=round(ms, 4), spread=[round(min(xs), 4), round(max(xs), 4)], n=len(xs),
                 round_ms=round(ms * LAYERS, 3), gb_s=round(out[rows]["bytes"] / ms / 1e6, 1))
    for rows in rows_list:
        print(f"{rows:>3} rows, {out[rows]['distinct_experts']} experts, bound {out[rows]['bound_ms']} ms: " + ", ".join(
            f"{n} {c['gpu_ms']:.3f} ms" for n, c in out[rows].items() if isinstance(c, dict) and "gpu_ms" in c),
            flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.union_launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16], help="rows per call (default 1 4 8 16)")
    ap.add_argument("--reps", type=int, default=6, help="interleaved repetitions (default 6)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed window (default 20)")
    ap.add_argument("--budget-s", type=float, default=240, help="stop repeating when less is left (default 240)")
    a = ap.parse_args(argv)
    run = Run("union_launch.json", budget_s=a.budget_s)
    import torch

    with torch.inference_mode():
        if run.step("synth", synth_layer, WORK, False, need_s=120) is None:
            return run.finish()
        loaded = run.step("load", load_layer, WORK, keep=False, need_s=60)
        if loaded is None:
            return run.finish()
        run.step("launch", measure, loaded[1], a.rows, a.reps, a.calls, run, need_s=30)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
