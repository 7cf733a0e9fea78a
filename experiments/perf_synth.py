"""One device call for the real-shape performance model (issue 7); results go to $OUT/perf.json as they come.

    source .device/on-device.sh && timeout 540 python -m experiments.perf_synth        (carry [".device"])

1. synthesise (toolkit.synthetic, on the GPU) the Qwen3.6-35B-A3B target at 4.0 bpw and the DFlash drafter at
   4.0, 6.0 and 8.0 bpw into /tmp/perf, timed (target: <= 180 s for the target);
2. load target + drafter 6.0 through Exl3Backend.from_dirs (caches first, the same size for both,
   max_history 15, drafter then target with draft_model=);
3. time exllamav3's forwards directly (experiments/perf_rig.py) for B {8, 16} x c {1, 4, 16, 32} x context
   {1k, 8k, 32k}: t_AR, and t_round with its breakdown; acceptance on random weights is meaningless, so no
   tau is measured; the toolkit's per-round bookkeeping is timed on the host; VRAM per combination modelled;
4. the same at 1k through exllamav3's own Generator (cross-check of the direct timings), drafters 4.0 and 8.0,
   then a layout check of synth against exllamav3's converter on tiny configs, as far as the budget allows.
Then, off the device: python -m experiments.perf_report --perf <files_at>/perf.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from experiments.harness import Run, convert_exl3
from experiments.perf_rig import PAGE, Rig, group, seq_cap, toolkit_cost

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "quantize" / "shapes"
GIB = 1024**3
BLOCKS, CONCS, CTXS = (8, 16), (1, 4, 16, 32), (1024, 8192, 32768)
ACCEPTED = {16: 7, 8: 5}       # round(published math500 tau) - 1 drafts kept per round: rewind and drafter-update lengths


@dataclass
class Perf:
    """The run (perf.json is its results), the options, and the toolkit's bookkeeping cost per (c, B)."""

    run: Run
    args: argparse.Namespace
    toolkit: dict = field(default_factory=dict)

    @property
    def report(self) -> dict:
        return self.run.results


# -- 1. synthesis -----------------------------------------------------------------------------------


def synth_all(perf: Perf) -> dict:
    from toolkit.synthetic import synth

    args, out = perf.args, {}
    jobs = [("target", SHAPES / "qwen3.6-35b-a3b.json", 4, args.work / "target-4.0")]
    jobs += [(f"draft-{b}", SHAPES / "qwen3.6-35b-a3b-dflash.json", int(float(b)), args.work / f"draft-{b}") for b in args.bits]
    for key, cfg, bits, folder in jobs:
        if (folder / "config.json").is_file() and not args.resynth:      # complete (synth renames it in at the end)
            out[key] = {"reused": str(folder)}
            continue
        res = synth(str(cfg), bits, str(folder), device="cuda", overwrite=True, quiet=True)
        out[key] = res
        perf.report["synth"] = out
        perf.run.log(f"synth {key}: {res['size']} in {res['seconds']} s")
        perf.run.save()
    torch.cuda.empty_cache()
    return out


# -- 2. loading and memory accounting ----------------------------------------------------------------


def cache_bytes(cache) -> tuple[int, int]:
    """(K/V bytes, recurrent-state bytes) that exllamav3 allocated for a cache."""
    kv = sum(layer.storage_size() for layer in cache.layers.values())
    st = sum(layer.storage_size() for layer in cache.recurrent_layers.values())
    return kv, st


def load(perf: Perf):
    from toolkit.exl3.backend import Exl3Backend

    args = perf.args
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    t = time.time()
    draft = args.work / f"draft-{args.bits[0]}"
    be = Exl3Backend.from_dirs(args.work / "target-4.0", draft, cache_tokens=args.cache_tokens,
                               max_concurrency=max(CONCS))
    secs = time.time() - t
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_allocated()
    (tkv, tst), (dkv, dst) = cache_bytes(be.cache), cache_bytes(be.draft_cache)
    wd = sum(f.stat().st_size for f in draft.glob("*.safetensors"))
    mem = perf.report["memory"]
    mem.update(load_seconds=round(secs, 1), cache_tokens=args.cache_tokens, slots=be.cache.num_slots,
               target_kv_bytes_per_token=tkv / be.cache.max_num_tokens, draft_kv_bytes_per_token=dkv / be.draft_cache.max_num_tokens,
               target_state_bytes_per_job=tst / be.cache.num_slots, draft_state_bytes_per_job=dst / be.draft_cache.num_slots,
               loaded_allocated_gib=(m1 - m0) / GIB, caches_gib=(tkv + tst + dkv + dst) / GIB,
               target_weights_gib=(m1 - m0 - tkv - tst - dkv - dst - wd) / GIB, draft_weights_gib={args.bits[0]: wd / GIB},
               embedding_on="cpu (exllamav3 keeps an unquantized embedding table in system RAM)")
    perf.run.log("loaded in", round(secs, 1), "s:", json.dumps({k: v for k, v in mem.items() if "gib" in k}, default=str)[:300])
    return be


def swap_draft(perf: Perf, rig: Rig, bits: str) -> None:
    """Unload the drafter and load another one with a fresh cache of the same size; the target stays."""
    exl = rig.be.exl
    if rig.be._gen is not None:                      # the cross-check's generator holds the old drafter
        rig.be._gen.close()
        rig.be._gen = None
    rig.d.unload()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    folder = perf.args.work / f"draft-{bits}"
    d = exl.Model.from_config(exl.Config.from_directory(str(folder)))
    dc = exl.Cache(d, max_num_tokens=rig.tc.max_num_tokens, max_batch_size=rig.tc.num_slots, max_history=rig.tc.max_history)
    d.load(progressbar=False)
    torch.cuda.synchronize()
    kv, st = cache_bytes(dc)
    perf.report["memory"]["draft_weights_gib"][bits] = (torch.cuda.memory_allocated() - m0 - kv - st) / GIB
    rig.be.draft, rig.be.draft_cache = d, dc
    rig.set_draft(d, dc)


# -- 3. the sweep ------------------------------------------------------------------------------------


def vram_gib(perf: Perf, bits: str, B: int, c: int, ctx: int, transient: int) -> float:
    """Modelled VRAM of one combination: weights + caches sized for it + peak transient + CUDA/outside-torch overhead."""
    m = perf.report["memory"]
    tok = c * seq_cap(ctx, B)
    kv = tok * (m["target_kv_bytes_per_token"] + m["draft_kv_bytes_per_token"])
    st = c * (m["target_state_bytes_per_job"] + m["draft_state_bytes_per_job"])
    w = m["target_weights_gib"] + m["draft_weights_gib"].get(bits, m["draft_weights_gib"][perf.args.bits[0]])
    return round(w + (kv + st + transient) / GIB + m.get("cuda_overhead_gib", 0.6), 3)


def add_combos(perf: Perf, bits: str, g: dict) -> None:
    ar = g.get("ar_ms") or next((x["ar_ms"] for x in perf.report["groups"] if x["c"] == g["c"] and x["ctx"] == g["ctx"]
                                 and x.get("ar_ms")), None)
    for B in BLOCKS:
        r = g.get(f"B{B}")
        if not r or ar is None:
            continue
        tk = perf.toolkit.get((g["c"], B), {}).get("total_ms", 0.0)
        terms = {**r["terms_ms"], "runtime": tk}
        perf.report["combos"].append({"bits": float(bits), "B": B, "c": g["c"], "ctx": g["ctx"], "t_ar_ms": ar,
                                      "t_round_ms": round(r["round_ms"] + tk, 4), "t_round_direct_ms": r["round_ms"],
                                      "terms": terms, "accepted": r["accepted"],
                                      "vram_gib": vram_gib(perf, bits, B, g["c"], g["ctx"], g["transient_bytes"])})


def sweep(perf: Perf, rig: Rig, bits: str, with_ar: bool) -> None:
    run, args = perf.run, perf.args
    for ctx in args.ctx:
        for c in CONCS:
            if run.left() < 15:
                run.errors[f"sweep-{bits}"] = f"stopped at ctx {ctx} c {c}: budget"
                return
            t = time.time()
            try:
                g = group(rig, c, ctx, BLOCKS, ACCEPTED, args.reps, args.warm, with_ar)
            except Exception as e:
                run.fail(f"group-{bits}-c{c}-ctx{ctx}", e)
                continue
            g["bits"] = float(bits)
            perf.report["groups"].append(g)
            add_combos(perf, bits, g)
            brief = {k: (v["round_ms"] if isinstance(v, dict) else v) for k, v in g.items() if k in ("ar_ms", "B8", "B16")}
            run.log(f"bits {bits} c={c:2d} ctx={ctx:5d}: {brief} ({time.time() - t:.1f}s)")
            run.save()


def overhead(perf: Perf) -> None:
    free, total = torch.cuda.mem_get_info()
    used, reserved = total - free, torch.cuda.memory_reserved()
    perf.report["memory"].update(device_used_gib=used / GIB, torch_reserved_gib=reserved / GIB,
                                 torch_allocated_gib=torch.cuda.memory_allocated() / GIB,
                                 cuda_overhead_gib=(used - reserved) / GIB, peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB)


def toolkit_costs(perf: Perf) -> None:
    for c in CONCS:
        for B in BLOCKS:
            perf.toolkit[(c, B)] = toolkit_cost(c, B, ACCEPTED[B])
    perf.report["toolkit_bookkeeping"] = list(perf.toolkit.values())


# -- 4. cross-checks ---------------------------------------------------------------------------------


def generator_check(perf: Perf, rig: Rig, ctx: int = 1024, rounds: int = 8, warm: int = 2) -> list:
    """Generator.iterate() per round on real jobs (prompts of random ids), with the toolkit's Round assembly timed."""
    from experiments.exl3_timing import run_jobs
    from toolkit.runtime.backend import GenSettings

    be, out, report = rig.be, [], perf.report
    for B in (None, *BLOCKS):
        for c in CONCS:
            if perf.run.left() < 20:
                break
            st = GenSettings(max_new_tokens=64, block_size=B, stop_ids=())
            prompts = [torch.randint(0, 248000, (ctx,)).tolist() for _ in range(c)]
            loop = run_jobs(be, prompts, st, speculative=B is not None, max_steps=warm + rounds + 2, keep_going=True)
            its, posts = loop.iterate_s[2 + warm:], loop.post_s[2 + warm:]      # prefill rounds first, then warm-up
            direct = next((x for x in report["combos"] if x["bits"] == float(perf.args.bits[0]) and x["B"] == B
                           and x["c"] == c and x["ctx"] == ctx), None)
            ar = next((g.get("ar_ms") for g in report["groups"] if g["c"] == c and g["ctx"] == ctx and g.get("ar_ms")), None)
            row = {"B": B, "c": c, "ctx": ctx, "iterate_ms": round(sorted(its)[len(its) // 2] * 1000, 3),
                   "toolkit_ms": round(sorted(posts)[len(posts) // 2] * 1000, 4),
                   "direct_ms": direct["t_round_direct_ms"] if direct else ar if B is None else None,
                   "capture_error": loop.capture_error}
            out.append(row)
            report["generator_check"] = out
            perf.run.log("generator", row)
            perf.run.save()
    for r in out:                                     # the Round assembly measured on real jobs, if costlier
        if r["B"] and (r["c"], r["B"]) in perf.toolkit:
            tk = perf.toolkit[(r["c"], r["B"])]
            tk["rounds_real_ms"] = r["toolkit_ms"]
            tk["total_ms"] = round(tk["hook_ms"] + max(tk["rounds_ms"], r["toolkit_ms"]), 4)
    for x in report["combos"]:
        x["terms"]["runtime"] = perf.toolkit.get((x["c"], x["B"]), {}).get("total_ms", 0.0)
        x["t_round_ms"] = round(x["t_round_direct_ms"] + x["terms"]["runtime"], 4)
    if be._gen is not None:                           # give the caches back to the direct forwards
        be._gen.close()
        be._gen = None
    rig.tc.reset_states()
    rig.dc.reset_states()
    return out


def tensor_meta(folder: Path) -> dict:
    """Tensor name -> (dtype, shape) over a folder's safetensors, read from the headers."""
    from safetensors import safe_open

    m = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                s = st.get_slice(k)
                m[k] = (s.get_dtype(), list(s.get_shape()))
    return m


def layout_check(perf: Perf) -> dict:
    """Convert tiny fixtures with exllamav3's converter and compare tensor names, dtypes and shapes with synth's."""
    from experiments.pair128 import moe_pair
    from toolkit.synthetic import synth

    work = perf.args.work / "layout"
    target_src, draft_src = moe_pair(work / "src")
    res = {}
    for key, src in (("draft", draft_src), ("target", target_src)):
        conv = work / f"{key}-exl3"
        try:
            convert_exl3(src, conv, 4, work / f"w-{key}", timeout=max(30, perf.run.left() - 10))
        except RuntimeError as e:
            res[key] = {"convert_failed": str(e)[-1200:]}
            continue
        cfg = json.loads((conv / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (work / f"{key}.json").write_text(json.dumps(cfg))
        synth(str(work / f"{key}.json"), 4, str(work / f"{key}-synth"), device="cuda", overwrite=True, quiet=True)
        a, b = tensor_meta(conv), tensor_meta(work / f"{key}-synth")
        shape = lambda x: x[1][:-1] if len(x[1]) == 3 else x[1]            # noqa: E731  (trellis: K may differ)
        res[key] = {"converter_only": sorted(set(a) - set(b))[:40], "synth_only": sorted(set(b) - set(a))[:40],
                    "dtype_or_shape_differs": [(k, a[k], b[k]) for k in sorted(set(a) & set(b))
                                               if a[k][0] != b[k][0] or shape(a[k]) != shape(b[k])][:40],
                    "trellis_bits_converter": sorted({a[k][1][-1] // 16 for k in a if k.endswith(".trellis")}),
                    "tensors": [len(a), len(b)]}
        perf.report["layout_check"] = res
        perf.run.save()
    return res


NOTES = [
    "Forwards are timed directly (acceptance on random weights is meaningless); rewind and drafter-update lengths "
    f"assume {ACCEPTED} drafts accepted per round (round(published math500 tau) - 1).",
    "exllamav3 runs the DFlash drafter at its native 16-token block for B=8 too; only the verified window is cut.",
    "Context filled without computing: zeroed K/V pages and exllamav3 test states (Cache.get_test_state) at the context length.",
    "VRAM: weights and cache bytes from torch.cuda.memory_allocated deltas and exllamav3's storage_size(); transient = "
    "max_memory_allocated above the resident set per (c, ctx); overhead = device used (mem_get_info) - torch reserved.",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m experiments.perf_synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=480, help="start no new phase after this many seconds (default 480)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/perf"), help="where the checkpoints go (default /tmp/perf)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default 5; medians)")
    ap.add_argument("--warm", type=int, default=2, help="untimed warm-up repetitions (default 2)")
    ap.add_argument("--ctx", type=int, nargs="+", default=list(CTXS), help="context lengths (default 1024 8192 32768)")
    ap.add_argument("--bits", nargs="+", default=["6.0", "4.0", "8.0"], help="drafter bitrates; the first is the headline")
    ap.add_argument("--no-layout-check", dest="layout", action="store_false", help="skip the converter comparison")
    ap.add_argument("--resynth", action="store_true", help="synthesise again even if --work already holds the checkpoints")
    args = ap.parse_args(argv)
    args.bits = [f"{float(b):.1f}" for b in args.bits]
    args.cache_tokens = max(CONCS) * seq_cap(max(args.ctx))
    return args


def measure(perf: Perf) -> None:
    """The phases in order; each records its failure and the later ones go on where they can."""
    run, args = perf.run, perf.args
    run.step("synth", synth_all, perf, keep=False)
    be = run.step("load", load, perf, need_s=60, keep=False)
    if be is None:
        if args.layout:
            run.step("layout_check", layout_check, perf, need_s=40, keep=False)
        return
    rig = run.step("rig", Rig, be, keep=False)
    if rig is None:
        return
    run.step("toolkit_bookkeeping", toolkit_costs, perf, keep=False)
    run.step(f"sweep-{args.bits[0]}", sweep, perf, rig, args.bits[0], True, need_s=30, keep=False)
    run.step("overhead", overhead, perf, keep=False)
    for c in perf.report["combos"]:                 # the overhead is known only now
        g = next(g for g in perf.report["groups"] if g["c"] == c["c"] and g["ctx"] == c["ctx"] and g["bits"] == c["bits"])
        c["vram_gib"] = vram_gib(perf, f"{c['bits']:.1f}", c["B"], c["c"], c["ctx"], g["transient_bytes"])
    run.step("generator_check", generator_check, perf, rig, need_s=40, keep=False)
    for bits in args.bits[1:]:
        run.step(f"swap-{bits}", swap_draft, perf, rig, bits, need_s=30, keep=False)
        if f"swap-{bits}" in run.errors:
            continue
        run.step(f"sweep-{bits}", sweep, perf, rig, bits, False, need_s=30, keep=False)
    if args.layout:
        run.step("layout_check", layout_check, perf, need_s=40, keep=False)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import exllamav3  # noqa: F401

    run = Run("perf.json", budget_s=args.budget_s)
    perf = Perf(run, args)
    run.results.update(combos=[], groups=[], memory={}, notes=list(NOTES), accepted_per_round=ACCEPTED, page=PAGE,
                       date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=torch.cuda.get_device_name(),
                       torch=torch.__version__, exllamav3="1.6.5",
                       command=" ".join(["source .device/on-device.sh && python -m experiments.perf_synth", *(argv or sys.argv[1:])]))
    run.save()
    with torch.inference_mode():          # exllamav3's caches are inference tensors: update them inside it
        measure(perf)
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
