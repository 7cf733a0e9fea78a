"""One device call for the real-shape performance model (issue 7); results go to $OUT/perf.json as they come.

    source .device/on-device.sh && timeout 540 python tests/gpu/perf_synth.py        (carry [".device"])

1. synthesise (toolkit.synthetic, on the GPU) the Qwen3.6-35B-A3B target at 4.0 bpw and the DFlash drafter at
   4.0, 6.0 and 8.0 bpw into /tmp/perf, timed (target: <= 180 s for the target);
2. load target + drafter 6.0 through Exl3Backend.from_dirs (caches first, the same size for both,
   max_history 15, drafter then target with draft_model=);
3. time exllamav3's forwards directly (tests/gpu/perf_rig.py) for B {8, 16} x c {1, 4, 16, 32} x context
   {1k, 8k, 32k}: t_AR, and t_round with its breakdown; acceptance on random weights is meaningless, so no
   tau is measured; the toolkit's per-round bookkeeping is timed on the host; VRAM per combination modelled;
4. the same at 1k through exllamav3's own Generator (cross-check of the direct timings), drafters 4.0 and 8.0,
   then a layout check of synth against exllamav3's converter on tiny configs, as far as the budget allows.
Then, off the device: python -m toolkit.perf --perf <files_at>/perf.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

import torch  # noqa: E402

from perf_rig import PAGE, Rig, group, seq_cap, toolkit_cost  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
SHAPES = ROOT / "quantize" / "shapes"
T0 = time.time()
GIB = 1024**3
BLOCKS, CONCS, CTXS = (8, 16), (1, 4, 16, 32), (1024, 8192, 32768)
ACCEPTED = {16: 7, 8: 5}       # round(published math500 tau) - 1 drafts kept per round: rewind and drafter-update lengths
REPORT: dict = {"combos": [], "groups": [], "errors": {}, "notes": [], "memory": {}}
ARGS = argparse.Namespace()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def left() -> float:
    return ARGS.budget_s - (time.time() - T0)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = OUT / ".perf.json.tmp"
    tmp.write_text(json.dumps(REPORT, indent=1, default=str))
    os.replace(tmp, OUT / "perf.json")


def guarded(name: str, fn, *a, need_s: float = 0.0, **k):
    """Run one phase; an exception is recorded with its traceback and the run goes on."""
    if left() < need_s:
        REPORT["errors"][name] = f"skipped: {left():.0f} s of budget left, needs about {need_s:.0f} s"
        log("SKIP", name)
        save()
        return None
    log("begin", name)
    t = time.time()
    try:
        res = fn(*a, **k)
        log("ok", name, f"{time.time() - t:.1f}s")
        return res
    except Exception as e:
        REPORT["errors"][name] = "".join(traceback.format_exception(e))[-3000:]
        log("FAILED", name, repr(e)[:500])
        return None
    finally:
        save()


# -- 1. synthesis -----------------------------------------------------------------------------------


def synth_all() -> dict:
    from toolkit.synthetic import synth

    out = {}
    jobs = [("target", SHAPES / "qwen3.6-35b-a3b.json", 4, ARGS.work / "target-4.0")]
    jobs += [(f"draft-{b}", SHAPES / "qwen3.6-35b-a3b-dflash.json", int(float(b)), ARGS.work / f"draft-{b}") for b in ARGS.bits]
    for key, cfg, bits, folder in jobs:
        if (folder / "config.json").is_file() and not ARGS.resynth:      # complete (synth renames it in at the end)
            out[key] = {"reused": str(folder)}
            continue
        res = synth(str(cfg), bits, str(folder), device="cuda", overwrite=True, quiet=True)
        out[key] = res
        REPORT["synth"] = out
        log(f"synth {key}: {res['size']} in {res['seconds']} s")
        save()
    torch.cuda.empty_cache()
    return out


# -- 2. loading and memory accounting ----------------------------------------------------------------


def cache_bytes(cache) -> tuple[int, int]:
    """(K/V bytes, recurrent-state bytes) that exllamav3 allocated for a cache."""
    kv = sum(layer.storage_size() for layer in cache.layers.values())
    st = sum(layer.storage_size() for layer in cache.recurrent_layers.values())
    return kv, st


def load():
    from toolkit.runtime.exl3_backend import Exl3Backend

    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    t = time.time()
    draft = ARGS.work / f"draft-{ARGS.bits[0]}"
    be = Exl3Backend.from_dirs(ARGS.work / "target-4.0", draft, cache_tokens=ARGS.cache_tokens,
                               max_concurrency=max(CONCS))
    secs = time.time() - t
    torch.cuda.synchronize()
    m1 = torch.cuda.memory_allocated()
    (tkv, tst), (dkv, dst) = cache_bytes(be.cache), cache_bytes(be.draft_cache)
    wd = sum(f.stat().st_size for f in draft.glob("*.safetensors"))
    mem = REPORT["memory"]
    mem.update(load_seconds=round(secs, 1), cache_tokens=ARGS.cache_tokens, slots=be.cache.num_slots,
               target_kv_bytes_per_token=tkv / be.cache.max_num_tokens, draft_kv_bytes_per_token=dkv / be.draft_cache.max_num_tokens,
               target_state_bytes_per_job=tst / be.cache.num_slots, draft_state_bytes_per_job=dst / be.draft_cache.num_slots,
               loaded_allocated_gib=(m1 - m0) / GIB, caches_gib=(tkv + tst + dkv + dst) / GIB,
               target_weights_gib=(m1 - m0 - tkv - tst - dkv - dst - wd) / GIB, draft_weights_gib={ARGS.bits[0]: wd / GIB},
               embedding_on="cpu (exllamav3 keeps an unquantized embedding table in system RAM)")
    log("loaded in", round(secs, 1), "s:", json.dumps({k: v for k, v in mem.items() if "gib" in k}, default=str)[:300])
    return be


def swap_draft(rig: Rig, bits: str) -> None:
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
    folder = ARGS.work / f"draft-{bits}"
    d = exl.Model.from_config(exl.Config.from_directory(str(folder)))
    dc = exl.Cache(d, max_num_tokens=rig.tc.max_num_tokens, max_batch_size=rig.tc.num_slots, max_history=rig.tc.max_history)
    d.load(progressbar=False)
    torch.cuda.synchronize()
    kv, st = cache_bytes(dc)
    REPORT["memory"]["draft_weights_gib"][bits] = (torch.cuda.memory_allocated() - m0 - kv - st) / GIB
    rig.be.draft, rig.be.draft_cache = d, dc
    rig.set_draft(d, dc)


# -- 3. the sweep ------------------------------------------------------------------------------------


def vram_gib(bits: str, B: int, c: int, ctx: int, transient: int) -> float:
    """Modelled VRAM of one combination: weights + caches sized for it + peak transient + CUDA/outside-torch overhead."""
    m = REPORT["memory"]
    tok = c * seq_cap(ctx, B)
    kv = tok * (m["target_kv_bytes_per_token"] + m["draft_kv_bytes_per_token"])
    st = c * (m["target_state_bytes_per_job"] + m["draft_state_bytes_per_job"])
    w = m["target_weights_gib"] + m["draft_weights_gib"].get(bits, m["draft_weights_gib"][ARGS.bits[0]])
    return round(w + (kv + st + transient) / GIB + m.get("cuda_overhead_gib", 0.6), 3)


def add_combos(bits: str, g: dict) -> None:
    ar = g.get("ar_ms") or next((x["ar_ms"] for x in REPORT["groups"] if x["c"] == g["c"] and x["ctx"] == g["ctx"]
                                 and x.get("ar_ms")), None)
    for B in BLOCKS:
        r = g.get(f"B{B}")
        if not r or ar is None:
            continue
        tk = TOOLKIT.get((g["c"], B), {}).get("total_ms", 0.0)
        terms = {**r["terms_ms"], "runtime": tk}
        REPORT["combos"].append({"bits": float(bits), "B": B, "c": g["c"], "ctx": g["ctx"], "t_ar_ms": ar,
                                 "t_round_ms": round(r["round_ms"] + tk, 4), "t_round_direct_ms": r["round_ms"],
                                 "terms": terms, "accepted": r["accepted"],
                                 "vram_gib": vram_gib(bits, B, g["c"], g["ctx"], g["transient_bytes"])})


def sweep(rig: Rig, bits: str, with_ar: bool) -> None:
    for ctx in ARGS.ctx:
        for c in CONCS:
            if left() < 15:
                REPORT["errors"][f"sweep-{bits}"] = f"stopped at ctx {ctx} c {c}: budget"
                return
            t = time.time()
            try:
                g = group(rig, c, ctx, BLOCKS, ACCEPTED, ARGS.reps, ARGS.warm, with_ar)
            except Exception as e:
                REPORT["errors"][f"group-{bits}-c{c}-ctx{ctx}"] = "".join(traceback.format_exception(e))[-2500:]
                log("FAILED group", bits, c, ctx, repr(e)[:300])
                save()
                continue
            g["bits"] = float(bits)
            REPORT["groups"].append(g)
            add_combos(bits, g)
            brief = {k: (v["round_ms"] if isinstance(v, dict) else v) for k, v in g.items() if k in ("ar_ms", "B8", "B16")}
            log(f"bits {bits} c={c:2d} ctx={ctx:5d}: {brief} ({time.time() - t:.1f}s)")
            save()


def overhead() -> None:
    free, total = torch.cuda.mem_get_info()
    used, reserved = total - free, torch.cuda.memory_reserved()
    REPORT["memory"].update(device_used_gib=used / GIB, torch_reserved_gib=reserved / GIB,
                            torch_allocated_gib=torch.cuda.memory_allocated() / GIB, cuda_overhead_gib=(used - reserved) / GIB,
                            peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB)


TOOLKIT: dict = {}


def toolkit_costs() -> None:
    for c in CONCS:
        for B in BLOCKS:
            TOOLKIT[(c, B)] = toolkit_cost(c, B, ACCEPTED[B])
    REPORT["toolkit_bookkeeping"] = list(TOOLKIT.values())


# -- 4. cross-checks ---------------------------------------------------------------------------------


def generator_check(rig: Rig, ctx: int = 1024, rounds: int = 8, warm: int = 2) -> list:
    """Generator.iterate() per round on real jobs (prompts of random ids), with the toolkit's Round assembly timed."""
    from toolkit.runtime.backend import GenSettings
    from toolkit.runtime.exl3_hook import JobTrack, build_round

    be, out = rig.be, []
    for B in (None, *BLOCKS):
        for c in CONCS:
            if left() < 20:
                break
            st = GenSettings(max_new_tokens=64, block_size=B, stop_ids=())
            gen = be.generator(be.draft_width(st, B is not None))
            prompts = [torch.randint(0, 248000, (ctx,)).tolist() for _ in range(c)]
            jobs = be._jobs(prompts, st)
            tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
            gen.enqueue(jobs)
            its, posts, err = [], [], None
            for step in range(warm + rounds + 2):
                t0 = time.perf_counter()
                gen.iterate()
                t1 = time.perf_counter()
                for job, tr in zip(jobs, tracks):          # Exl3Backend.generate_many's per-round work
                    ids = job.sequences[0].sequence_ids
                    n = len(ids)
                    if n != tr.seen:
                        new = ids.torch_slice(tr.seen, n).reshape(-1).tolist()
                        try:
                            build_round(tr, new, job.draft_stats, gen.drafted.get(id(job)), gen.t_draft_ms, (t1 - t0) * 1000)
                        except RuntimeError as e:             # a capture problem is a finding, not a reason to stop
                            err, tr.seen, tr.stats_seen = str(e)[:300], n, len(job.draft_stats)
                if step >= 2 + warm:                        # prefill rounds first, then warm-up
                    its.append(t1 - t0)
                    posts.append(time.perf_counter() - t1)
            gen.clear_queue()
            direct = next((x for x in REPORT["combos"] if x["bits"] == float(ARGS.bits[0]) and x["B"] == B and x["c"] == c and x["ctx"] == ctx), None)
            ar = next((g.get("ar_ms") for g in REPORT["groups"] if g["c"] == c and g["ctx"] == ctx and g.get("ar_ms")), None)
            row = {"B": B, "c": c, "ctx": ctx, "iterate_ms": round(sorted(its)[len(its) // 2] * 1000, 3),
                   "toolkit_ms": round(sorted(posts)[len(posts) // 2] * 1000, 4),
                   "direct_ms": direct["t_round_direct_ms"] if direct else ar if B is None else None, "capture_error": err}
            out.append(row)
            REPORT["generator_check"] = out
            log("generator", row)
            save()
    for r in out:                                     # the Round assembly measured on real jobs, if costlier
        if r["B"] and (r["c"], r["B"]) in TOOLKIT:
            tk = TOOLKIT[(r["c"], r["B"])]
            tk["rounds_real_ms"] = r["toolkit_ms"]
            tk["total_ms"] = round(tk["hook_ms"] + max(tk["rounds_ms"], r["toolkit_ms"]), 4)
    for x in REPORT["combos"]:
        x["terms"]["runtime"] = TOOLKIT.get((x["c"], x["B"]), {}).get("total_ms", 0.0)
        x["t_round_ms"] = round(x["t_round_direct_ms"] + x["terms"]["runtime"], 4)
    if be._gen is not None:                           # give the caches back to the direct forwards
        be._gen.close()
        be._gen = None
    rig.tc.reset_states()
    rig.dc.reset_states()
    return out


def layout_check() -> dict:
    """Convert tiny fixtures with exllamav3's converter and compare tensor names, dtypes and shapes with synth's."""
    from safetensors import safe_open

    from pair128 import moe_pair
    from toolkit.synthetic import synth

    work = ARGS.work / "layout"
    target_src, draft_src = moe_pair(work / "src")
    res = {}
    for key, src in (("draft", draft_src), ("target", target_src)):
        conv = work / f"{key}-exl3"
        p = subprocess.run([sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(conv),
                            "-w", str(work / f"w-{key}"), "-b", "4"], capture_output=True, text=True, timeout=max(30, left() - 10))
        if p.returncode:
            res[key] = {"convert_failed": (p.stdout + p.stderr)[-1200:]}
            continue
        cfg = json.loads((conv / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (work / f"{key}.json").write_text(json.dumps(cfg))
        synth(str(work / f"{key}.json"), 4, str(work / f"{key}-synth"), device="cuda", overwrite=True, quiet=True)

        def meta(folder: Path) -> dict:
            m = {}
            for f in folder.glob("*.safetensors"):
                with safe_open(str(f), "pt") as st:
                    for k in st.keys():
                        s = st.get_slice(k)
                        m[k] = (s.get_dtype(), list(s.get_shape()))
            return m

        a, b = meta(conv), meta(work / f"{key}-synth")
        shape = lambda x: x[1][:-1] if len(x[1]) == 3 else x[1]            # noqa: E731  (trellis: K may differ)
        res[key] = {"converter_only": sorted(set(a) - set(b))[:40], "synth_only": sorted(set(b) - set(a))[:40],
                    "dtype_or_shape_differs": [(k, a[k], b[k]) for k in sorted(set(a) & set(b))
                                               if a[k][0] != b[k][0] or shape(a[k]) != shape(b[k])][:40],
                    "trellis_bits_converter": sorted({a[k][1][-1] // 16 for k in a if k.endswith(".trellis")}),
                    "tensors": [len(a), len(b)]}
        REPORT["layout_check"] = res
        save()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=480, help="start no new phase after this many seconds (default 480)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/perf"), help="where the checkpoints go (default /tmp/perf)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default 5; medians)")
    ap.add_argument("--warm", type=int, default=2, help="untimed warm-up repetitions (default 2)")
    ap.add_argument("--ctx", type=int, nargs="+", default=list(CTXS), help="context lengths (default 1024 8192 32768)")
    ap.add_argument("--bits", nargs="+", default=["6.0", "4.0", "8.0"], help="drafter bitrates; the first is the headline")
    ap.add_argument("--no-layout-check", dest="layout", action="store_false", help="skip the converter comparison")
    ap.add_argument("--resynth", action="store_true", help="synthesise again even if --work already holds the checkpoints")
    ap.parse_args(namespace=ARGS)
    ARGS.bits = [f"{float(b):.1f}" for b in ARGS.bits]
    ARGS.cache_tokens = max(CONCS) * seq_cap(max(ARGS.ctx))
    import exllamav3  # noqa: F401

    REPORT.update(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, exllamav3="1.6.5", command="source .device/on-device.sh && python tests/gpu/perf_synth.py "
                  + " ".join(sys.argv[1:]), accepted_per_round=ACCEPTED, page=PAGE)
    REPORT["notes"] += [
        "Forwards are timed directly (acceptance on random weights is meaningless); rewind and drafter-update lengths "
        f"assume {ACCEPTED} drafts accepted per round (round(published math500 tau) - 1).",
        "exllamav3 runs the DFlash drafter at its native 16-token block for B=8 too; only the verified window is cut.",
        "Context filled without computing: zeroed K/V pages and exllamav3 test states (Cache.get_test_state) at the context length.",
        "VRAM: weights and cache bytes from torch.cuda.memory_allocated deltas and exllamav3's storage_size(); transient = "
        "max_memory_allocated above the resident set per (c, ctx); overhead = device used (mem_get_info) - torch reserved.",
    ]
    save()
    guarded("synth", synth_all, need_s=0)
    be = guarded("load", load, need_s=60)
    if be is None:
        if ARGS.layout:
            guarded("layout_check", layout_check, need_s=40)
        return
    rig = guarded("rig", Rig, be)
    if rig is None:
        return
    guarded("toolkit_bookkeeping", toolkit_costs)
    guarded(f"sweep-{ARGS.bits[0]}", sweep, rig, ARGS.bits[0], True, need_s=30)
    guarded("overhead", overhead)
    for c in REPORT["combos"]:                      # the overhead is known only now
        g = next(g for g in REPORT["groups"] if g["c"] == c["c"] and g["ctx"] == c["ctx"] and g["bits"] == c["bits"])
        c["vram_gib"] = vram_gib(f"{c['bits']:.1f}", c["B"], c["c"], c["ctx"], g["transient_bytes"])
    guarded("generator_check", generator_check, rig, need_s=40)
    for bits in ARGS.bits[1:]:
        guarded(f"swap-{bits}", swap_draft, rig, bits, need_s=30)
        if f"swap-{bits}" in REPORT["errors"]:
            continue
        guarded(f"sweep-{bits}", sweep, rig, bits, False, need_s=30)
    if ARGS.layout:
        guarded("layout_check", layout_check, need_s=40)
    REPORT["seconds"] = round(time.time() - T0, 1)
    save()
    log("done; errors:", list(REPORT["errors"]) or "none")


if __name__ == "__main__":
    with torch.inference_mode():          # exllamav3's caches are inference tensors: update them inside it
        main()
