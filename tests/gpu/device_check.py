"""One device call that checks the exllamav3 backend end to end; results go to $OUT/device_check.json.

    source .device/on-device.sh && python3 tests/gpu/device_check.py

Builds the fixtures (the trained tiny pair; its drafter as BF16 and as EXL3 4.0 bpw; a random
Qwen3.5-MoE-shaped target with recurrent layers), then checks: greedy losslessness against the backend's own
AR baseline token for token over 24 prompts, per drafter and block size; that every Round is consistent with
the final tokens (and with the unhooked library generator's); the stream shape against the torch backend;
the hook's per-round overhead; tok/s of AR and speculative through the bench CLI. Every check runs even when
an earlier one fails; failures are recorded with their traceback.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

import torch  # noqa: E402

from stream_shape import assert_stream_shape  # noqa: E402
from toolkit.runtime.backend import GenSettings  # noqa: E402
from toolkit.runtime.events import summarize, tokens_of  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/dev")
T0 = time.time()
REPORT: dict = {"checks": {}, "errors": {}}
QUICK = os.environ.get("DEVICE_QUICK") == "1"      # the short re-run: fewer steps, prompts and checks
MAX_NEW = 48 if QUICK else 64
NPROMPTS = 20 if QUICK else 24


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def check(name: str):
    def wrap(fn):
        def run(*a, **k):
            log("begin", name)
            try:
                REPORT["checks"][name] = fn(*a, **k)
                log("ok", name, json.dumps(REPORT["checks"][name])[:600])
            except Exception as e:                     # record and go on with the next check
                REPORT["errors"][name] = "".join(traceback.format_exception(e))[-3000:]
                log("FAILED", name, repr(e)[:400])
            save()
        return run
    return wrap


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "device_check.json").write_text(json.dumps(REPORT, indent=1, default=str))


def free(be) -> None:
    if be is not None:
        be.close()
    gc.collect()
    torch.cuda.empty_cache()


# -- fixtures ---------------------------------------------------------------------------------------


def to_bf16(src: Path, dst: Path) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in dst.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def convert(src: Path, dst: Path, bits: float = 4.0) -> dict:
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(dst),
                        "-w", str(WORK / f"work-{dst.name}"), "-b", str(bits)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"convert {src.name} failed: {(p.stdout + p.stderr)[-1500:]}")
    return {"seconds": round(time.time() - t, 1), "bytes": sum(f.stat().st_size for f in dst.glob("*.safetensors"))}


FIX: dict = {}


@check("fixtures")
def build_fixtures() -> dict:
    import shutil

    from pair128 import moe_pair, train_pair
    from toolkit.assets.fixtures import build

    WORK.mkdir(parents=True, exist_ok=True)
    out = {}
    try:                                   # trained hidden-128 pair (exllamav3 cannot load the hidden-64 one)
        steps = dict(target_steps=400, draft_steps=700, sequences=256) if QUICK else {}
        t, d, secs = train_pair(WORK / "pair128", **steps)
        out["pair128_train_s"] = round(secs, 1)
    except Exception as e:                 # fall back to random models: still lossless checks, no acceptance
        out["pair128_error"] = repr(e)[:600]
        t, d = build(WORK / "rand128", arch="llama", block_size=16, hidden=128)
    FIX["target"], FIX["draft_bf16"] = t, d
    t0 = time.time()
    try:                                   # trained: wide top-1 margins, so a divergence means a rollback bug
        if "moe" in os.environ.get("DEVICE_CHECKS", "moe"):
            FIX["moe_target"], FIX["moe_draft"] = moe_pair(WORK / "moe", trained=True, **({"target_steps": 500, "draft_steps": 500} if QUICK else {}))
            out["moe_trained_s"] = round(time.time() - t0, 1)
    except Exception as e:
        out["moe_train_error"] = repr(e)[:600]
        FIX["moe_target"], FIX["moe_draft"] = moe_pair(WORK / "moe-random")
    for key, src in (("draft_exl3", FIX["draft_bf16"]), ("target_exl3", FIX["target"]))[: (0 if os.environ.get("DEVICE_COMBOS") else 1) if QUICK else 2]:
        try:
            out[key] = convert(src, WORK / key)
            FIX[key] = WORK / key
        except RuntimeError as e:
            out[key] = str(e)[-600:]
    shutil.rmtree(WORK / "work-draft_exl3", ignore_errors=True)
    return out


def doc_prompts(tokenizer, n: int = 24, length: int = 32) -> list[list[int]]:
    """32-token windows of stdlib docstrings: the tiny pair's training domain, so rounds accept 0..B-1."""
    from toolkit.train.tiny import corpus

    ids = tokenizer.encode(corpus())
    step = (len(ids) - length) // (n + 1)
    return [ids[(k + 1) * step:(k + 1) * step + length] for k in range(n)]


def reference_agreement(src: Path, prompts: list[list[int]], exl_ar: list[list[int]], max_new: int,
                        exl_spec: list[list[int]] | None = None) -> dict:
    """AR tokens of the torch reference (fp32 on the GPU) vs exllamav3's AR baseline and, when given, exllamav3's
    speculative output vs its AR baseline. At each first divergence: the reference's top-1 margin (logit gap to the
    runner-up) after the common prefix, so a near-tie tells itself apart from a real bug."""
    from toolkit.runtime.torch_backend import TorchBackend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tb = TorchBackend.from_dirs(src, device=dev, dtype=torch.float32)

    @torch.no_grad()
    def margin(prefix: list[int]) -> float:
        top = tb.target(input_ids=torch.tensor([prefix], device=dev)).logits[0, -1].float().topk(2).values
        return round(float(top[0] - top[1]), 4)

    def diverge(p: list[int], x: list[int], y: list[int]) -> dict:
        i = next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
        return {"at": i, "tokens": [x[i] if i < len(x) else None, y[i] if i < len(y) else None], "ref_margin": margin(p + x[:i])}

    out: dict = {}
    try:
        ref = [tokens_of(tb.generate(p, GenSettings(max_new_tokens=max_new), speculative=False)) for p in prompts]
        parts = [diverge(p, r, e) for p, r, e in zip(prompts, ref, exl_ar) if r != e]
        out["ref_ar_vs_exl3_ar"] = {"same": f"{len(prompts) - len(parts)}/{len(prompts)}", "divergences": parts}
        if exl_spec is not None:
            parts = [diverge(p, a, s) for p, a, s in zip(prompts, exl_ar, exl_spec) if a != s]
            out["exl3_ar_vs_exl3_spec"] = {"same": f"{len(prompts) - len(parts)}/{len(prompts)}", "divergences": parts}
        ms = [m["ref_margin"] for v in out.values() for m in v["divergences"]]
        out["median_ref_margin_all_positions"] = round(statistics.median(
            margin(p + r[:k]) for p, r in zip(prompts[:4], ref[:4]) for k in range(0, len(r), 8)), 4)
        out["max_margin_at_divergence"] = max(ms, default=None)
    finally:
        tb = None                          # frees the reference model before the next check
        gc.collect()
        torch.cuda.empty_cache()
    return out


# -- checks -----------------------------------------------------------------------------------------


def lossless(be, prompts: list[list[int]], B: int, label: str) -> dict:
    """Greedy spec vs AR per prompt (1 job), rounds vs final tokens, the batched run, and the unhooked library."""
    st = GenSettings(max_new_tokens=MAX_NEW, block_size=B)
    stop = set(be.eos_ids)
    same, rounds_all, kinds = 0, [], {"zero": 0, "partial": 0, "full": 0}
    ar_all, spec_all = [], []
    for p in prompts:
        ar = tokens_of(list(be.generate(p, st, speculative=False)))
        rounds = list(be.generate(p, st))
        spec = tokens_of(rounds)
        assert_stream_shape(rounds, width=B - 1, max_new_tokens=MAX_NEW, stop_ids=stop)
        same += spec == ar
        ar_all.append(ar)
        spec_all.append(spec)
        rounds_all += rounds
        for r in rounds[1:-1]:
            kinds["full" if r.full else "zero" if r.accepted == 0 else "partial"] += 1
    batched = {i: [] for i in range(len(prompts))}
    for i, r in be.generate_many(prompts, st):
        batched[i].append(r)
    batch_same = sum(tokens_of(batched[i]) == spec_all[i] for i in batched)
    ar_batch = {i: [] for i in range(len(prompts))}
    for i, r in be.generate_many(prompts, st, speculative=False):
        ar_batch[i].append(r)
    ar_batch_same = sum(tokens_of(ar_batch[i]) == ar_all[i] for i in ar_batch)
    plain, _, _ = be.generate_plain(prompts[:4], st)
    s = summarize(rounds_all)
    res = {"label": label, "B": B, "prompts": len(prompts), "lossless_1job": f"{same}/{len(prompts)}",
           "batched_spec_equals_1job": f"{batch_same}/{len(prompts)}", "batched_ar_equals_1job": f"{ar_batch_same}/{len(prompts)}",
           "unhooked_equals_hooked": f"{sum(plain[i] == spec_all[i] for i in range(4))}/4",
           "tau": round(s.tau, 3), "rounds": kinds, "accept_per_position": [round(a, 3) for a in s.accept_per_position]}
    res["_ar"], res["_spec"], res["ok"] = ar_all, spec_all, same == len(prompts)
    res["first_diff"] = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                         for x, y in zip(spec_all, ar_all) if x != y][:10]
    return res


@check("lossless")
def check_lossless() -> dict:
    from toolkit.runtime.exl3_backend import Exl3Backend

    out = {}
    combos = [("bf16-drafter", FIX["target"], FIX["draft_bf16"])]
    if "draft_exl3" in FIX:
        combos.append(("exl3-drafter", FIX["target"], FIX["draft_exl3"]))
    if "target_exl3" in FIX and "draft_exl3" in FIX:
        combos.append(("exl3-target+exl3-drafter", FIX["target_exl3"], FIX["draft_exl3"]))
    failures = []
    only = os.environ.get("DEVICE_COMBOS")                # e.g. bf16-drafter: a re-run of one combination
    combos = [c for c in combos if not only or c[0] in only.split(",")]
    for label, t, d in combos:
        be = None
        try:
            be = Exl3Backend.from_dirs(t, d, cache_tokens=32 * 512, max_concurrency=32)
            prompts = doc_prompts(be.tokenizer, n=NPROMPTS)
        except Exception as e:
            failures.append(f"{label}: load: {e!r}"[:500])
            out[label] = "".join(traceback.format_exception(e))[-1500:]
            free(be)
            continue
        for B in (8, 16):
            try:
                res = out[f"{label}-B{B}"] = lossless(be, prompts, B, label)
                ar, _ = res.pop("_ar"), res.pop("_spec")
                if not res["ok"]:
                    failures.append(f"{label} B={B}: lossless on {res['lossless_1job']} prompts")
                if label == "bf16-drafter" and B == 8:
                    out["reference_vs_exl3_ar"] = reference_agreement(FIX["target"], prompts, ar, MAX_NEW)
            except Exception as e:
                failures.append(f"{label} B={B}: {e!r}"[:500])
                out[f"{label}-B{B}"] = "FAILED: " + "".join(traceback.format_exception(e))[-1500:]
        free(be)
        REPORT["checks"]["lossless_detail"] = out          # kept even when a combination fails
    assert not failures, "; ".join(failures)
    return out


@check("recurrent_moe")
def check_moe() -> dict:
    from toolkit.runtime.exl3_backend import Exl3Backend

    be = Exl3Backend.from_dirs(FIX["moe_target"], FIX["moe_draft"], cache_tokens=32 * 512, max_concurrency=32)
    prompts = doc_prompts(be.tokenizer, n=20)
    try:
        out = {}
        for B in (8, 16):
            res = out[f"B{B}"] = lossless(be, prompts, B, "qwen3_5_moe")
            ar, spec = res.pop("_ar"), res.pop("_spec")
            REPORT["checks"]["recurrent_moe_detail"] = out
            if B == 8:                     # the reference tells a near-tie from a rollback bug
                src = FIX["moe_target"].parent / "target-src"
                out["reference"] = reference_agreement(src, prompts, ar, MAX_NEW, spec)
        bad = [k for k, v in out.items() if isinstance(v, dict) and v.get("ok") is False]
        assert not bad, f"qwen3_5_moe: not lossless at {bad}"
        return out
    finally:
        free(be)


@check("sampling_and_stops")
def check_sampling() -> dict:
    from toolkit.runtime.exl3_backend import Exl3Backend

    be = Exl3Backend.from_dirs(FIX["target"], FIX["draft_bf16"], cache_tokens=8 * 512, max_concurrency=8)
    prompts = doc_prompts(be.tokenizer, n=8)
    try:
        hot = GenSettings(max_new_tokens=MAX_NEW, temperature=0.8, seed=3, block_size=16)
        rs = [list(be.generate(p, hot)) for p in prompts]
        for r in rs:
            assert_stream_shape(r, width=15, max_new_tokens=MAX_NEW)
        again = [tokens_of(be.generate(p, hot)) for p in prompts]
        ar = tokens_of(be.generate(prompts[0], GenSettings(max_new_tokens=MAX_NEW), speculative=False))
        stop_tok = ar[min(10, len(ar) - 1)]
        st = GenSettings(max_new_tokens=MAX_NEW, block_size=16, stop_ids=(stop_tok,))
        cut = list(be.generate(prompts[0], st))
        assert_stream_shape(cut, width=15, max_new_tokens=MAX_NEW, stop_ids={stop_tok})
        ar_cut = tokens_of(be.generate(prompts[0], st, speculative=False))
        assert tokens_of(cut) == ar_cut == ar[: ar.index(stop_tok) + 1]
        short = tokens_of(be.generate(prompts[1], GenSettings(max_new_tokens=5, block_size=16)))
        assert len(short) <= 5
        return {"temperature_tau": round(summarize([x for r in rs for x in r]).tau, 3),
                "seeded_repeat_equal": sum(tokens_of(a) == b for a, b in zip(rs, again)), "stop_at": len(ar_cut), "max5": len(short)}
    finally:
        free(be)


@check("shape_vs_torch")
def check_shape() -> dict:
    from toolkit.runtime.exl3_backend import Exl3Backend
    from toolkit.runtime.torch_backend import TorchBackend

    tb = TorchBackend.from_dirs(FIX["target"], FIX["draft_bf16"], device="cpu")
    eb = Exl3Backend.from_dirs(FIX["target"], FIX["draft_bf16"], cache_tokens=4 * 512, max_concurrency=4)
    try:
        prompts = doc_prompts(tb.tokenizer, n=6)
        chat = tb.encode("Return the number of items in a container.")
        assert eb.encode("Return the number of items in a container.") == chat
        agree = 0
        for p in prompts + [chat]:
            st = GenSettings(max_new_tokens=32, block_size=16)
            t_rounds, e_rounds = list(tb.generate(p, st)), list(eb.generate(p, st))
            for rounds in (t_rounds, e_rounds):
                assert_stream_shape(rounds, width=15, max_new_tokens=32, stop_ids=set(tb.eos_ids))
            agree += tokens_of(t_rounds) == tokens_of(e_rounds)
        return {"prompts": len(prompts) + 1, "same_tokens_torch_vs_exl3": agree}
    finally:
        free(eb)


@check("hook_overhead")
def check_overhead() -> dict:
    from toolkit.runtime.exl3_backend import Exl3Backend

    be = Exl3Backend.from_dirs(FIX["target"], FIX["draft_bf16"], cache_tokens=32 * 512, max_concurrency=32)
    out = {}
    try:
        prompts = doc_prompts(be.tokenizer, n=24)
        st = GenSettings(max_new_tokens=128, block_size=16)
        for name, batches in (("conc1", [[p] for p in prompts[:4 if QUICK else 8]]), ("conc24", [prompts])):
            per = {"plain": [], "hook_only": [], "hook_and_rounds": []}
            iters, direct = {}, []
            for rep in range(4 if QUICK else 6):       # interleaved; rep 0 is a warm-up
                tot = {k: [0.0, 0] for k in per}
                ours = 0.0
                for batch in batches:
                    for _ in be.generate_many(batch, st):
                        pass
                    ours += be.overhead_s
                    tot["hook_and_rounds"][0] += be.seconds
                    tot["hook_and_rounds"][1] += be.iterations
                    for k, hooked in (("plain", False), ("hook_only", True)):
                        _, secs, it = be.generate_plain(batch, st, hooked=hooked)
                        tot[k][0] += secs
                        tot[k][1] += it
                for k, (secs, it) in tot.items():
                    per[k].append(secs / it)
                    iters[k] = it
                direct.append(ours / tot["hook_and_rounds"][0] * 100)
            med = {k: statistics.median(v[1:]) for k, v in per.items()}
            out[name] = {f"{k}_ms_per_round": round(v * 1000, 4) for k, v in med.items()}
            out[name].update({f"{k}_overhead_pct": round((med[k] / med["plain"] - 1) * 100, 2) for k in ("hook_only", "hook_and_rounds")})
            out[name]["direct_capture_and_rounds_pct"] = round(statistics.median(direct[1:]), 3)   # timed inside our code
            out[name].update(rounds=iters, all_ms={k: [round(x * 1000, 3) for x in v] for k, v in per.items()})
        return out
    finally:
        free(be)


@check("cli")
def check_cli() -> dict:
    env = {**os.environ}
    g = subprocess.run([sys.executable, "-m", "toolkit.generate", "--backend", "exllamav3", "--target", str(FIX["target"]),
                        "--draft", str(FIX["draft_bf16"]), "--prompt", "Return a new list", "--compare-ar", "--json",
                        "--max-new-tokens", "48"], capture_output=True, text=True, env=env, cwd=ROOT)
    out = {}
    if g.returncode == 0:
        j = json.loads(g.stdout.strip().splitlines()[-1])
        out["generate"] = {k: j[k] for k in ("backend", "tau", "tok_s", "ar_tok_s", "speedup", "lossless")}
    else:
        out["generate"] = "FAILED: " + g.stderr[-800:]
    docs = WORK / "doc_prompts.txt"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIX["target"]))
    docs.write_text("\n".join(tok.decode(p).replace("\n", " ") for p in doc_prompts(tok, n=NPROMPTS)))
    quick = ["--concurrency", "1", "4", "16", "32", "--max-new-tokens", "64", "--limit", "32"] if QUICK else ["--max-new-tokens", "128"]
    for name, extra, draft in (("bench_doc_bf16", ["--prompts", str(docs), "--raw"], FIX["draft_bf16"]),
                               ("bench_doc_exl3", ["--prompts", str(docs), "--raw"], FIX.get("draft_exl3")),
                               ("bench_builtin_bf16", [], FIX["draft_bf16"])):
        if time.time() - T0 > (330 if QUICK else 480) or draft is None or (QUICK and name == "bench_doc_exl3"):
            out[name] = "skipped"
            continue
        b = subprocess.run([sys.executable, "-m", "toolkit.bench", "--backend", "exllamav3", "--target", str(FIX["target"]),
                            "--draft", str(draft), "--out", str(OUT / name), *quick, *extra],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        if b.returncode:
            out[name] = "FAILED: " + b.stderr[-800:]
            continue
        print(b.stdout, flush=True)
        cells = json.loads((OUT / name / "bench.json").read_text())["cells"]
        out[name] = [[c["block_size"], c["concurrency"], round(c["tau"], 2), round(c["tok_s"]), round(c["ar_tok_s"]),
                      round(c["speedup"], 2), c["lossless"]] for c in cells]
    return out


@check("errors")
def check_errors() -> dict:
    from toolkit.core.errors import ToolkitError
    from toolkit.runtime.exl3_backend import Exl3Backend

    import shutil

    bad = Path(shutil.copytree(FIX["draft_bf16"], WORK / "draft-bad", dirs_exist_ok=True))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    (bad / "config.json").write_text(json.dumps(cfg))
    msgs = {}
    for name, kw in (("memory", {"cache_tokens": 256 * 4_000_000}), ("drafter_mismatch", {})):
        try:
            d = FIX["draft_bf16"] if name == "memory" else bad
            Exl3Backend.from_dirs(FIX["target"], d, **kw)
            msgs[name] = "no error raised"
        except ToolkitError as e:
            msgs[name] = str(e)
    return msgs


if __name__ == "__main__":
    REPORT["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    REPORT["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    build_fixtures()
    default = "lossless,moe,cli" if QUICK else "lossless,moe,sampling,shape,overhead,errors,cli"
    chosen = os.environ.get("DEVICE_CHECKS", default).split(",")       # e.g. DEVICE_CHECKS=moe,overhead
    steps = {"lossless": check_lossless, "moe": check_moe, "sampling": check_sampling, "shape": check_shape,
             "overhead": check_overhead, "errors": check_errors, "cli": check_cli}
    if "target" in FIX:
        for name in chosen:
            steps[name]()
    (OUT / "pair").write_text(f"{FIX.get('target')}:{FIX.get('draft_bf16')}")
    REPORT["seconds"] = round(time.time() - T0, 1)
    save()
    log("errors:", list(REPORT["errors"]) or "none")
    sys.exit(1 if REPORT["errors"] else 0)
