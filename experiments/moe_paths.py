"""The MoE paths (toolkit/exl3/moe.py: union, grouped, exllamav3's stock) on the real MoE shape, beside exllamav3's
dense EXL3 kernel.

One call (about 4-6 minutes; results to $OUT/moe_paths.json after every step):

    source .device/on-device.sh && timeout 480 python -m experiments.moe_paths            (carry [".device"])

Where a step stalls, run it alone: SIGABRT makes Python print every thread's stack, and EXL3_DEBUG_AUTOTUNE makes
exllamav3 name (and synchronise) each launch of its kernel tuner:

    PYTHONFAULTHANDLER=1 EXL3_DEBUG_AUTOTUNE=1 timeout -s ABRT 80 python -m experiments.moe_paths \
        --steps agreement --check-rows 1 2 8 16

1. synthesise (toolkit.synthetic, on the GPU) a one-layer cut of the Qwen3.6-35B-A3B target at 4.0 bpw (256
   experts, hidden 2048, expert width 512, 8 routed and a gated shared expert) into /tmp/moe_paths (kept on a
   warm machine) and load it with exllamav3; its BlockSparseMLP is the layer under test;
2. decode: the grouped path's Triton decode against exllamav3's reconstruct kernel bit for bit on every codebook
   and bitrate the converter writes and on the layer's own experts (the union path decodes with exllamav3's own
   GEMM kernel);
3. agreement: each path against exllamav3's BlockSparseMLP.forward on the same rows (random hidden states, routed
   by the layer's router) at `--check-rows`, and against a dense fp32 reference from get_weight_tensor;
4. the dense kernel: LinearEXL3.forward on a 2048 x 30720 random EXL3 matrix in the layer's format (60 experts'
   gate+up side by side) at every `--rows`: GB/s of coded bytes, the rate the MoE paths are held to;
5. speed: per layer call, stock vs grouped vs union (the lever's forward, routing included), the union's own
   kernels alone and the router alone, at `--rows`; >= 10 interleaved repetitions of `--calls` calls each
   between CUDA events (medians), host ms per call, and each path's decode rate: the distinct experts' coded
   bytes (routed and shared) over its GPU ms less the router's; x 40 layers gives the MoE ms of a round;
6. torch.profiler over a few calls of each path at `--profile-rows`: GPU time per kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from experiments.harness import Run, device_name, env_float
from experiments.moe_decode import check_decode

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ROOT / "quantize" / "shapes" / "qwen3.6-35b-a3b.json"
WORK = Path("/tmp/moe_paths")
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}     # bytes/s, from the device name
STEPS = ("decode", "agreement", "dense", "timing", "profile")
LAYERS = 40                       # MoE layers of the target: a round is 40 calls


def bandwidth(name: str) -> float | None:
    return next((b for k, b in BANDWIDTH.items() if k in name), None)


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4), "n": len(xs)}


# -- 1. the layer ---------------------------------------------------------------------------------------------


def synth_layer(work: Path, resynth: bool) -> dict:
    """The one-layer cut of the target at 4.0 bpw (reused when present)."""
    import torch

    from toolkit.synthetic import synth

    folder = work / "layer-4.0"
    if (folder / "config.json").is_file() and not resynth:
        return {"reused": str(folder)}
    cfg = json.loads(SHAPE.read_text())
    text = cfg["text_config"]
    text.update(num_hidden_layers=1, layer_types=["linear_attention"])
    work.mkdir(parents=True, exist_ok=True)
    shape = work / "shape-1layer.json"
    shape.write_text(json.dumps(cfg))
    out = synth(str(shape), 4, str(folder), device="cuda", overwrite=True, quiet=True)
    torch.cuda.empty_cache()
    return {k: out[k] for k in ("out", "bits", "codebook", "size", "seconds")}


def load_layer(work: Path):
    """(model, its BlockSparseMLP, facts about the layer)."""
    import exllamav3 as exl
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    model = exl.Model.from_config(exl.Config.from_directory(str(work / "layer-4.0")))
    model.load(device="cuda:0", progressbar=False)
    moe = next(m for m in model if isinstance(m, BlockSparseMLP))
    lin = moe.gates[0].inner
    info = {"experts": moe.num_experts, "per_token": moe.num_experts_per_tok, "hidden": moe.hidden_size,
            "intermediate": moe.intermediate_size, "K": lin.K, "mcg": lin.mcg, "mul1": lin.mul1,
            "shared": moe.shared_experts is not None, "shared_gate": moe.shared_gate is not None,
            "support_fused": getattr(moe, "support_fused", None), "fused_rows": getattr(moe, "fused_rows", None),
            "activation": moe.activation_fn, "router": getattr(moe.routing_fn, "__name__", "?")}
    return model, moe, info


def why_not(moe) -> list[str]:
    """The layer's eligibility attributes when the grouped path does not apply to it (empty when it does)."""
    from toolkit.exl3 import moe as lever

    names = ("bc", "is_quantized", "support_quant_paths", "gated", "activation_fn", "act_limit", "interm_div",
             "latent_in", "routed_pre_norm", "routed_post_norm", "routing_gate", "alt_residual_channel", "tp_reduce",
             "routing_device", "cpu_split_first", "cpu_offload", "num_local_experts", "num_experts",
             "intermediate_size", "intermediate_size_padded", "shared_experts_post_norm")
    return [] if lever.applies(moe, {}) else [f"{n}={getattr(moe, n, None)!r}"[:80] for n in names]


# -- 2. decode: check_decode, in experiments/moe_decode.py ----------------------------------------------------


# -- 3. agreement ---------------------------------------------------------------------------------------------


def hidden_rows(moe, rows: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((1, rows, moe.hidden_size), generator=g, device="cuda").half()


def route(moe, x):
    rows = x.numel() // x.shape[-1]
    sel, w = moe.routing_fn(rows, moe.routing_cfg, x.view(rows, -1), {})
    return sel.clone(), w.clone()


def dense_reference(moe, x, sel, w):
    """fp32 output of the layer from exllamav3's dequantised weights (get_weight_tensor)."""
    import torch

    y = x.view(-1, x.shape[-1]).float()
    out = torch.zeros_like(y)

    def mlp(g, u, d, rows):
        a = rows @ g.get_weight_tensor().float()
        return (a * torch.sigmoid(a) * (rows @ u.get_weight_tensor().float())) @ d.get_weight_tensor().float()

    for e in sel.unique().tolist():
        r, s = (sel == e).nonzero(as_tuple=True)
        out.index_add_(0, r, mlp(moe.gates[e].inner, moe.ups[e].inner, moe.downs[e].inner, y[r]) * w[r, s].float()[:, None])
    se = moe.shared_experts
    if se is not None:
        sh = mlp(se.gates[0].inner, se.ups[0].inner, se.downs[0].inner, y)
        if moe.shared_gate is not None:
            sh = sh * torch.sigmoid(y @ moe.shared_gate.inner.weight.float().view(-1))[:, None]
        out += sh
    return out


def wrap(moe, *paths: str):
    """The lever's forward on `moe` with these paths on (none: exllamav3's own through the wrap)."""
    from toolkit.exl3 import moe as lever

    lever.ROWS.update(WIDE)
    w = lever.MoeForward(moe)
    w.on.update({p: True for p in paths})
    return w


PATHS = {"stock": (), "grouped": ("grouped",), "union": ("union",), "packed": ("packed",)}
# Each path timed at every row count it can take, not only where the lever sends it.
WIDE = {"union": (1, 64), "packed": (1, 512), "grouped": (1, 64)}


def synced(label: str, fn):
    """fn() then a device sync, its label printed before and after: a stalled kernel is named by the last line."""
    import torch

    print(f"agreement: {label} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    print(f"ok ({time.perf_counter() - t0:.2f} s)", flush=True)
    return out


def check_agreement(moe, rows_list) -> dict:
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    wraps = {name: wrap(moe, *on) for name, on in PATHS.items() if on}
    out = {}
    for rows in rows_list:
        x = hidden_rows(moe, rows, seed=rows)
        sel, w = synced(f"{rows} rows, route", lambda: route(moe, x))
        stock = synced(f"{rows} rows, stock", lambda: BlockSparseMLP.forward(moe, x, {}).clone().float().view(rows, -1))
        ref = synced(f"{rows} rows, dense reference", lambda: dense_reference(moe, x, sel, w))
        diff = lambda a, b: float((a - b).abs().max())
        row = {"stock_vs_dense": diff(stock, ref), "scale": float(ref.abs().max()),
               "distinct_experts": int(sel.unique().numel())}
        for name, f in wraps.items():
            y = synced(f"{rows} rows, {name}", lambda: f(x, {}).float().view(rows, -1))
            row[f"{name}_vs_stock"], row[f"{name}_vs_dense"] = diff(y, stock), diff(y, ref)
            if name in ("union", "packed"):        # the second call captures a graph, the third replays it
                again = [synced(f"{rows} rows, {name} graph {i}", lambda: f(x, {}).float().view(rows, -1))
                         for i in ("capture", "replay")]
                row[f"{name}_graphs_vs_eager"] = max(diff(z, y) for z in again)
            row[f"{name}_calls"] = {k: v for k, v in f.calls.items() if v} | ({"unfit": f.unfit} if f.unfit else {})
        out[rows] = row
    out["paths"] = {name: dict(f.calls) for name, f in wraps.items()}
    out["unfit"] = {name: f.unfit for name, f in wraps.items()}
    return out


# -- 4-6. speed -----------------------------------------------------------------------------------------------


def expert_bytes(moe) -> tuple[int, int, int]:
    """(bytes of one routed expert, of the shared expert, of the router) as stored on the GPU."""
    size = lambda lin: sum(t.numel() * t.element_size() for t in (lin.trellis, lin.suh, lin.svh))
    routed = sum(size(m[0].inner) for m in (moe.gates, moe.ups, moe.downs))
    se = moe.shared_experts
    shared = sum(size(m[0].inner) for m in (se.gates, se.ups, se.downs)) if se is not None else 0
    gate = moe.routing_cfg.gate_tensor if moe.routing_cfg is not None else None
    return routed, shared, (gate.numel() * gate.element_size() if gate is not None else 0)


def timed(fn, calls: int) -> tuple[float, float]:
    """(GPU ms per call between CUDA events, host ms per call) over `calls` back-to-back calls."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.synchronize()
    return start.elapsed_time(end) / calls, host


def dense_rate(moe, rows_list, calls: int) -> dict:
    """exllamav3's dense EXL3 kernel on 2048 x 30720 in the layer's format: GB/s of coded bytes per row count."""
    import torch
    from exllamav3.modules.quant.exl3 import LinearEXL3

    from toolkit.moe.ref import tile_words

    src = moe.gates[0].inner
    k, n = moe.hidden_size, 30720
    g = torch.Generator().manual_seed(1)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, tile_words(src.K)), dtype=torch.int16, generator=g).cuda()
    sign = lambda m: ((torch.randint(0, 2, (m,), generator=g) * 2 - 1).half()).cuda()
    marker = torch.tensor(1, dtype=torch.int32).cuda()
    lin = LinearEXL3(None, k, n, suh=sign(k), svh=sign(n), trellis=trellis, mcg=marker if src.mcg else None,
                     mul1=marker if src.mul1 else None)
    coded = trellis.numel() * 2
    out = {"shape": [k, n], "K": src.K, "coded_bytes": coded}
    for rows in rows_list:
        x = torch.randn((rows, k), device="cuda").half()
        lin.forward(x, {})
        ms = statistics.median(timed(lambda: lin.forward(x, {}), calls)[0] for _ in range(5))
        out[rows] = {"ms": round(ms, 4), "gb_s": round(coded / ms / 1e6, 1)}
    return out


def variants(moe, rows: int) -> tuple[dict, int]:
    """The timed callables at `rows` rows, and how many distinct experts their routing touches."""
    from toolkit.moe.packed import packed_forward
    from toolkit.moe.union import union_forward

    x = hidden_rows(moe, rows, seed=100 + rows)
    sel, w = route(moe, x)
    fns = {name: (lambda f: lambda: f(x, {}))(wrap(moe, *on)) for name, on in PATHS.items()}
    eager = wrap(moe, "union")
    eager.graph_union = False
    fns["union_eager"] = lambda: eager(x, {})
    u = wrap(moe, "union")
    u(x, {})
    y = x.view(rows, -1)
    if rows <= 64:                                         # the union path's workspace stops there
        fns["union_kernels"] = lambda: union_forward(y, sel, w, u.tables["union"], u.mgemm)
    p = wrap(moe, "packed")
    p(x, {})
    for m in (8, 16):                                      # rows per slot, eager
        fns[f"packed{m}_eager"] = (lambda m: lambda: packed_forward(y, sel, w, p.tables["packed"], p.mgemm, m=m))(m)
    fns["router"] = lambda: moe.routing_fn(rows, moe.routing_cfg, y, {})
    return fns, int(sel.unique().numel())


def time_layer(run: Run, moe, rows_list, reps: int, calls: int, dense: dict | None) -> dict:
    (routed, shared, router), bw = expert_bytes(moe), bandwidth(device_name())
    fns, out = {}, {"bytes_per_expert": routed, "bytes_shared": shared, "bytes_router": router, "bandwidth": bw}
    for rows in rows_list:
        fns[rows], distinct = variants(moe, rows)
        for fn in fns[rows].values():                      # compile, tune and warm every shape
            fn()
            fn()
        coded = distinct * routed + shared
        out[rows] = {"distinct_experts": distinct, "bytes_experts": coded,
                     "bound_ms_experts": round(coded / bw * 1e3, 4) if bw else None}
    samples, host = ({(r, n): [] for r in rows_list for n in fns[r]} for _ in range(2))
    for rep in range(reps):
        if rep >= 3 and run.left() < 45:
            run.log(f"timing: stopping after {rep} repetitions, {run.left():.0f} s left")
            break
        for rows in rows_list:
            for name, fn in fns[rows].items():
                gpu, h = timed(fn, calls)
                samples[(rows, name)].append(gpu)
                host[(rows, name)].append(h)
    for (rows, name), xs in samples.items():
        out[rows][name] = {"gpu_ms": summary(xs), "host_ms": summary(host[(rows, name)])}
    for rows in rows_list:
        cell = out[rows]
        med = lambda n: cell[n]["gpu_ms"]["median"]
        for name in ("stock", "grouped", "union", "union_eager", "packed", "packed8_eager", "packed16_eager"):
            experts_ms = med(name) - med("router")
            cell[f"{name}_round_ms"] = round(med(name) * LAYERS, 3)
            cell[f"{name}_gb_s"] = round(cell["bytes_experts"] / experts_ms / 1e6, 1) if experts_ms > 0 else None
            if dense and rows in dense:
                cell[f"{name}_over_dense_rate"] = round((cell[f"{name}_gb_s"] or 0) / dense[rows]["gb_s"], 3)
        cell["stock_over_union"] = round(med("stock") / med("union"), 3)
    return out


def profile(moe, rows_list, calls: int = 5) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = {}
    for rows in rows_list:
        fns, _ = variants(moe, rows)
        for name in ("union", "union_eager", "packed", "stock"):
            fns[name]()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fns[name]()
                torch.cuda.synchronize()
            rows_ = []
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t:
                    rows_.append({"kernel": ev.key[:90], "us_per_call": round(t / calls, 1),
                                  "launches_per_call": ev.count / calls})
            rows_.sort(key=lambda r: -r["us_per_call"])
            out[f"{name}@{rows}"] = {"kernels": rows_[:10], "total_us_per_call": round(sum(r["us_per_call"] for r in rows_), 1)}
    return out


def environment() -> dict:
    import exllamav3
    import torch
    import triton

    return {"device": device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "exllamav3": getattr(exllamav3, "__version__", "?")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.moe_paths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=WORK, help="where the one-layer checkpoint lives (default /tmp/moe_paths)")
    ap.add_argument("--resynth", action="store_true", help="synthesise again even when present")
    ap.add_argument("--check-rows", type=int, nargs="+", default=[1, 2, 8, 16, 32, 64, 128])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128], help="rows per call timed")
    ap.add_argument("--profile-rows", type=int, nargs="*", default=[1, 8, 16], help="rows per call profiled")
    ap.add_argument("--reps", type=int, default=10, help="interleaved repetitions (default 10)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed window (default 20)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                    help="which of steps 2-6 to run, in this order (default all; a run that stalls in one step can "
                         "measure the others in a call of their own)")
    ap.add_argument("--budget-s", type=float, default=env_float("MOE_PATHS_BUDGET_S", 450),
                    help="start no step that does not fit in what is left of it (default 450)")
    a = ap.parse_args(argv)
    run = Run("moe_paths.json", budget_s=a.budget_s)
    run.results.update(args={k: str(v) for k, v in vars(a).items()})
    import torch

    with torch.inference_mode():
        run.step("environment", environment)
        if run.step("synth", synth_layer, a.work, a.resynth, need_s=120) is None:
            return run.finish()
        loaded = run.step("load", load_layer, a.work, keep=False, need_s=60)
        if loaded is None:
            return run.finish()
        model, moe, info = loaded
        run.results["layer"] = info
        run.results["why_not"] = why_not(moe)
        dense = None
        for name in a.steps:
            if name == "decode":
                run.step("decode", check_decode, moe, need_s=90)
            elif name == "agreement":
                run.step("agreement", check_agreement, moe, a.check_rows, need_s=40)
            elif name == "dense":
                dense = run.step("dense", dense_rate, moe, a.rows, a.calls, need_s=20)
            elif name == "timing":
                run.step("timing", time_layer, run, moe, a.rows, a.reps, a.calls, dense, need_s=90)
            else:
                run.step("profile", profile, moe, a.profile_rows, need_s=20)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
