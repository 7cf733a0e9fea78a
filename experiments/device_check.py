"""One device call that checks the exllamav3 backend end to end; results go to $OUT/device_check.json.

    source .device/on-device.sh && python -m experiments.device_check        (carry [".device"])

Builds the fixtures (the trained tiny pair; its drafter as BF16 and as EXL3 4.0 bpw; a random
Qwen3.5-MoE-shaped target with recurrent layers), then checks: greedy losslessness against the backend's own
AR baseline token for token over 24 prompts, per drafter and block size, and on the MoE target converted to EXL3
(`moe_exl3`); the adopted graph_draft_swa lever off and on (`draft_swa`); that every Round is consistent with
the final tokens (and with the unhooked library generator's); the stream shape against the torch backend;
the hook's per-round overhead; tok/s of AR and speculative through the bench CLI. Every check runs even when
an earlier one fails; failures are recorded with their traceback; once the budget is spent, checks not yet
begun are recorded as skipped. --quick (or DEVICE_QUICK=1) is the short
re-run: fewer steps, prompts and checks; --checks / --combos (DEVICE_CHECKS, DEVICE_COMBOS) pick a subset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments.harness import Run, convert_exl3, device_name, free_cuda, tail
from experiments.exl3_loop import check_overhead, doc_prompts, lossless, reference_agreement
from tests.stream_shape import assert_stream_shape
from toolkit.exl3.options import ADOPTED
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import summarize, tokens_of

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/dev")
CHECKS = ("lossless", "moe", "moe_exl3", "moe_grouped", "moe_union", "moe_packed", "moe_graphs", "draft_swa", "sampling",
          "shape", "overhead", "errors", "cli")
QUICK_CHECKS = ("lossless", "moe", "cli")


@dataclass
class Ctx:
    """What every check reads: the run (results, budget), the options and the fixtures built."""

    run: Run
    quick: bool = False
    checks: tuple[str, ...] = CHECKS
    combos: tuple[str, ...] = ()                         # e.g. bf16-drafter: a re-run of one combination
    fix: dict = field(default_factory=dict)

    @property
    def max_new(self) -> int:
        return 48 if self.quick else 64

    @property
    def nprompts(self) -> int:
        return 20 if self.quick else 24


# -- fixtures ---------------------------------------------------------------------------------------


def build_fixtures(ctx: Ctx) -> dict:
    from experiments.pair128 import train_pair
    from toolkit.assets.fixtures import build

    WORK.mkdir(parents=True, exist_ok=True)
    fix, out = ctx.fix, {}
    if all(c.startswith("moe") for c in ctx.checks):       # --checks moe,moe_exl3: the MoE pair alone
        return {**out, **moe_fixture(ctx)}
    try:                                   # trained hidden-128 pair (exllamav3 cannot load the hidden-64 one)
        steps = {"target_steps": 400, "draft_steps": 700, "sequences": 256} if ctx.quick else {}
        t, d, secs = train_pair(WORK / "pair128", **steps)
        out["pair128_train_s"] = round(secs, 1)
    except Exception as e:                 # fall back to random models: still lossless checks, no acceptance
        out["pair128_error"] = repr(e)[:600]
        t, d = build(WORK / "rand128", arch="llama", block_size=16, hidden=128)
    fix["target"], fix["draft_bf16"] = t, d
    if any(c.startswith("moe") for c in ctx.checks):
        out.update(moe_fixture(ctx))
    for key, src in (("draft_exl3", fix["draft_bf16"]), ("target_exl3", fix["target"]))[: (0 if ctx.combos else 1) if ctx.quick else 2]:
        try:
            out[key] = convert_exl3(src, WORK / key, 4.0)
            fix[key] = WORK / key
        except RuntimeError as e:
            out[key] = str(e)[-600:]
    shutil.rmtree(WORK / "work-draft_exl3", ignore_errors=True)
    return out


def moe_fixture(ctx: Ctx) -> dict:
    """The Qwen3.5-MoE-shaped pair, trained (wide top-1 margins, so a divergence means a rollback bug), else random."""
    from experiments.pair128 import moe_pair

    t0, out = time.time(), {}
    try:
        steps = {"target_steps": 500, "draft_steps": 500} if ctx.quick else {}
        ctx.fix["moe_target"], ctx.fix["moe_draft"] = moe_pair(WORK / "moe", trained=True, **steps)
        out["moe_trained_s"] = round(time.time() - t0, 1)
    except Exception as e:
        out["moe_train_error"] = repr(e)[:600]
        ctx.fix["moe_target"], ctx.fix["moe_draft"] = moe_pair(WORK / "moe-random")
    return out


# -- checks -----------------------------------------------------------------------------------------


def check_lossless(ctx: Ctx) -> dict:
    from toolkit.exl3.backend import Exl3Backend

    fix, out = ctx.fix, {}
    combos = [("bf16-drafter", fix["target"], fix["draft_bf16"])]
    if "draft_exl3" in fix:
        combos.append(("exl3-drafter", fix["target"], fix["draft_exl3"]))
    if "target_exl3" in fix and "draft_exl3" in fix:
        combos.append(("exl3-target+exl3-drafter", fix["target_exl3"], fix["draft_exl3"]))
    failures = []
    combos = [c for c in combos if not ctx.combos or c[0] in ctx.combos]
    for label, t, d in combos:
        be = None
        try:
            be = Exl3Backend.from_dirs(t, d, cache_tokens=32 * 512, max_concurrency=32)
            prompts = doc_prompts(be.tokenizer, n=ctx.nprompts)
        except Exception as e:
            failures.append(f"{label}: load: {e!r}"[:500])
            out[label] = tail(e, 1500)
            free_cuda(be)
            continue
        for B in (8, 16):
            try:
                res = out[f"{label}-B{B}"] = lossless(be, prompts, B, label, ctx.max_new)
                ar, _ = res.pop("_ar"), res.pop("_spec")
                if not res["ok"]:
                    failures.append(f"{label} B={B}: lossless on {res['lossless_1job']} prompts")
                if label == "bf16-drafter" and B == 8:
                    out["reference_vs_exl3_ar"] = reference_agreement(fix["target"], prompts, ar, ctx.max_new)
            except Exception as e:
                failures.append(f"{label} B={B}: {e!r}"[:500])
                out[f"{label}-B{B}"] = "FAILED: " + tail(e, 1500)
        free_cuda(be)
        ctx.run.steps["lossless_detail"] = out          # kept even when a combination fails
    assert not failures, "; ".join(failures)
    return out


def check_moe(ctx: Ctx) -> dict:
    from toolkit.exl3.backend import Exl3Backend

    be = Exl3Backend.from_dirs(ctx.fix["moe_target"], ctx.fix["moe_draft"], cache_tokens=32 * 512, max_concurrency=32)
    prompts = doc_prompts(be.tokenizer, n=20)
    try:
        out = {}
        for B in (8, 16):
            res = out[f"B{B}"] = lossless(be, prompts, B, "qwen3_5_moe", ctx.max_new)
            ar, spec = res.pop("_ar"), res.pop("_spec")
            ctx.run.steps["recurrent_moe_detail"] = out
            if B == 8:                     # the reference tells a near-tie from a rollback bug
                src = ctx.fix["moe_target"].parent / "target-src"
                out["reference"] = reference_agreement(src, prompts, ar, ctx.max_new, spec)
        bad = [k for k, v in out.items() if isinstance(v, dict) and v.get("ok") is False]
        assert not bad, f"qwen3_5_moe: not lossless at {bad}"
        return out
    finally:
        free_cuda(be)


def off_and_on(ctx: Ctx, be, prompts, lever: str, names: tuple[str, str], label: str, out: dict, detail: str,
               base=None) -> int:
    """lossless() at B=16 with the switch `lever` off, then on (over `base`, default exllamav3's own options), into
    out[names[0]] and out[names[1]] (saved as `detail` after each); returns how many speculative outputs the two
    runs share (out["same_ar_output"]: how many AR outputs)."""
    from dataclasses import replace

    from toolkit.exl3.options import Exl3Options

    spec, ar = {}, {}
    for on in (False, True):
        be.set_options(replace(base or Exl3Options(), **{lever: on}))
        res = out[names[on]] = lossless(be, prompts, 16, f"{label} {lever}={on}", ctx.max_new)
        ar[on], spec[on] = res.pop("_ar"), res.pop("_spec")
        ctx.run.steps[detail] = out
    out["same_ar_output"] = f"{sum(a == b for a, b in zip(ar[True], ar[False]))}/{len(prompts)}"
    return sum(a == b for a, b in zip(spec[True], spec[False]))


def check_moe_exl3(ctx: Ctx) -> dict:
    """The trained MoE target converted to EXL3 4.0 bpw (exllamav3's fused MoE kernels serve only quantized
    experts): greedy speculative output at B=16 against the backend's own AR, one job and batched."""
    from toolkit.exl3.backend import Exl3Backend

    dst = WORK / "moe_exl3"
    out = {"convert": convert_exl3(ctx.fix["moe_target"], dst, 4.0) if not (dst / "config.json").is_file() else "kept"}
    be = Exl3Backend.from_dirs(dst, ctx.fix["moe_draft"], cache_tokens=32 * 512, max_concurrency=32)
    try:
        res = out["B16"] = lossless(be, doc_prompts(be.tokenizer, n=20), 16, "moe_exl3", ctx.max_new)
        del res["_ar"], res["_spec"]
        assert res["ok"], f"moe_exl3: lossless on {res['lossless_1job']} prompts"
        return out
    finally:
        free_cuda(be)


def check_moe_lever(ctx: Ctx, lever: str = "grouped_moe", base=None) -> dict:
    """A lever (grouped_moe, union_moe, packed_moe alone; forward_graphs over the defaults, in a process started with
    EXL3_GRAPHS=0) on the trained MoE target as EXL3 4.0 bpw: B=16 off and on, each against the backend's own AR
    under the same options, both runs' outputs compared, and how many calls the lever served."""
    from toolkit.exl3.backend import Exl3Backend

    dst = WORK / "moe_exl3"
    out = {"convert": convert_exl3(ctx.fix["moe_target"], dst, 4.0) if not (dst / "config.json").is_file() else "kept"}
    be = Exl3Backend.from_dirs(dst, ctx.fix["moe_draft"], cache_tokens=32 * 512, max_concurrency=32)
    try:
        prompts = doc_prompts(be.tokenizer, n=20)
        out["same_spec_output"] = off_and_on(ctx, be, prompts, lever, ("off", "on"), "moe_exl3", out,
                                             f"{lever}_detail", base)
        out["engine"] = e = be.engine_report() or {}
        served = e.get("forward_graphs", {}).get("target", {}).get("replayed", 0) if lever == "forward_graphs" else \
            e.get("moe_paths", {}).get(lever.removesuffix("_moe"), 0)
        assert served > 0, f"{lever} never ran"
        n = len(prompts)                   # the graphs replay the eager kernels: not a token may change
        assert lever != "forward_graphs" or (out["same_spec_output"], out["same_ar_output"]) == (n, f"{n}/{n}"), \
            "forward_graphs changed the output"
        return out
    finally:
        free_cuda(be)


def check_draft_swa(ctx: Ctx) -> dict:
    """The adopted graph_draft_swa lever on the trained pair's EXL3 drafter (a causal sliding layer + a full one):
    B=16 with the lever off and on. Passes when both are lossless and the lever drafts what the eager path drafts
    (same speculative output, tau within 2 %: the graphed kernels round differently)."""
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.exl3.draft_levers import exllamav3_classes

    be = Exl3Backend.from_dirs(ctx.fix["target"], ctx.fix["draft_exl3"], cache_tokens=32 * 512, max_concurrency=32)
    prompts = doc_prompts(be.tokenizer, n=ctx.nprompts)
    try:
        swa_class = exllamav3_classes()[0]
        out = {"swa_layers": sum(isinstance(m, swa_class) for m in be.draft)}
        same = off_and_on(ctx, be, prompts, "graph_draft_swa", ("off", "on"), "exl3-drafter", out, "draft_swa_detail")
        out["same_spec_output"] = f"{same}/{len(prompts)}"
        assert out["swa_layers"], "the drafter has no sliding-window layer: the check proves nothing"
        assert out["on"]["ok"] and out["off"]["ok"], "not lossless"
        assert abs(out["on"]["tau"] - out["off"]["tau"]) <= 0.02 * out["off"]["tau"], "the lever changed tau"
        return out
    finally:
        free_cuda(be)


def check_sampling(ctx: Ctx) -> dict:
    from toolkit.exl3.backend import Exl3Backend

    be = Exl3Backend.from_dirs(ctx.fix["target"], ctx.fix["draft_bf16"], cache_tokens=8 * 512, max_concurrency=8)
    prompts = doc_prompts(be.tokenizer, n=8)
    max_new = ctx.max_new
    try:
        hot = GenSettings(max_new_tokens=max_new, temperature=0.8, seed=3, block_size=16)
        rs = [list(be.generate(p, hot)) for p in prompts]
        for r in rs:
            assert_stream_shape(r, width=15, max_new_tokens=max_new)
        again = [tokens_of(be.generate(p, hot)) for p in prompts]
        ar = tokens_of(be.generate(prompts[0], GenSettings(max_new_tokens=max_new), speculative=False))
        stop_tok = ar[min(10, len(ar) - 1)]
        st = GenSettings(max_new_tokens=max_new, block_size=16, stop_ids=(stop_tok,))
        cut = list(be.generate(prompts[0], st))
        assert_stream_shape(cut, width=15, max_new_tokens=max_new, stop_ids={stop_tok})
        ar_cut = tokens_of(be.generate(prompts[0], st, speculative=False))
        assert tokens_of(cut) == ar_cut == ar[: ar.index(stop_tok) + 1]
        short = tokens_of(be.generate(prompts[1], GenSettings(max_new_tokens=5, block_size=16)))
        assert len(short) <= 5
        return {"temperature_tau": round(summarize([x for r in rs for x in r]).tau, 3),
                "seeded_repeat_equal": sum(tokens_of(a) == b for a, b in zip(rs, again)), "stop_at": len(ar_cut), "max5": len(short)}
    finally:
        free_cuda(be)


def check_shape(ctx: Ctx) -> dict:
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.runtime.torch_backend import TorchBackend

    tb = TorchBackend.from_dirs(ctx.fix["target"], ctx.fix["draft_bf16"], device="cpu")
    eb = Exl3Backend.from_dirs(ctx.fix["target"], ctx.fix["draft_bf16"], cache_tokens=4 * 512, max_concurrency=4)
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
        free_cuda(eb)


def check_cli(ctx: Ctx) -> dict:
    fix, outdir = ctx.fix, ctx.run.path.parent
    g = subprocess.run([sys.executable, "-m", "toolkit.generate", "--backend", "exllamav3", "--target", str(fix["target"]),
                        "--draft", str(fix["draft_bf16"]), "--prompt", "Return a new list", "--compare-ar", "--json",
                        "--max-new-tokens", "48"], capture_output=True, text=True, cwd=ROOT)
    out = {}
    if g.returncode == 0:
        j = json.loads(g.stdout.strip().splitlines()[-1])
        out["generate"] = {k: j[k] for k in ("backend", "tau", "tok_s", "ar_tok_s", "speedup", "lossless")}
    else:
        out["generate"] = "FAILED: " + g.stderr[-800:]
    docs = WORK / "doc_prompts.txt"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fix["target"]))
    docs.write_text("\n".join(tok.decode(p).replace("\n", " ") for p in doc_prompts(tok, n=ctx.nprompts)))
    quick = ["--concurrency", "1", "4", "16", "32", "--max-new-tokens", "64", "--limit", "32"] if ctx.quick else ["--max-new-tokens", "128"]
    for name, extra, draft in (("bench_doc_bf16", ["--prompts", str(docs), "--raw"], fix["draft_bf16"]),
                               ("bench_doc_exl3", ["--prompts", str(docs), "--raw"], fix.get("draft_exl3")),
                               ("bench_builtin_bf16", [], fix["draft_bf16"])):
        if ctx.run.left() < 0 or draft is None or (ctx.quick and name == "bench_doc_exl3"):
            out[name] = "skipped"
            continue
        b = subprocess.run([sys.executable, "-m", "toolkit.bench", "--backend", "exllamav3", "--target", str(fix["target"]),
                            "--draft", str(draft), "--out", str(outdir / name), *quick, *extra],
                           capture_output=True, text=True, cwd=ROOT)
        if b.returncode:
            out[name] = "FAILED: " + b.stderr[-800:]
            continue
        print(b.stdout, flush=True)
        cells = json.loads((outdir / name / "bench.json").read_text())["cells"]
        out[name] = [[c["block_size"], c["concurrency"], round(c["tau"], 2), round(c["tok_s"]), round(c["ar_tok_s"]),
                      round(c["speedup"], 2), c["lossless"]] for c in cells]
    return out


def check_errors(ctx: Ctx) -> dict:
    from toolkit.core.errors import ToolkitError
    from toolkit.exl3.backend import Exl3Backend

    bad = Path(shutil.copytree(ctx.fix["draft_bf16"], WORK / "draft-bad", dirs_exist_ok=True))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    (bad / "config.json").write_text(json.dumps(cfg))
    msgs = {}
    for name, kw in (("memory", {"cache_tokens": 256 * 4_000_000}), ("drafter_mismatch", {})):
        try:
            d = ctx.fix["draft_bf16"] if name == "memory" else bad
            Exl3Backend.from_dirs(ctx.fix["target"], d, **kw)
            msgs[name] = "no error raised"
        except ToolkitError as e:
            msgs[name] = str(e)
    return msgs


STEPS = {"lossless": ("lossless", check_lossless), "moe": ("recurrent_moe", check_moe),
         "moe_exl3": ("moe_exl3", check_moe_exl3), "moe_grouped": ("moe_grouped", check_moe_lever),
         "moe_union": ("moe_union", lambda ctx: check_moe_lever(ctx, "union_moe")),
         "moe_packed": ("moe_packed", lambda ctx: check_moe_lever(ctx, "packed_moe")),
         "moe_graphs": ("moe_graphs", lambda ctx: check_moe_lever(ctx, "forward_graphs", ADOPTED)), "draft_swa": ("graph_draft_swa", check_draft_swa),
         "sampling": ("sampling_and_stops", check_sampling), "shape": ("shape_vs_torch", check_shape),
         "overhead": ("hook_overhead", lambda ctx: check_overhead(ctx.fix, ctx.quick)), "errors": ("errors", check_errors), "cli": ("cli", check_cli)}


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m experiments.device_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", default=env("DEVICE_QUICK") == "1",
                    help="the short re-run: fewer steps, prompts and checks (default: DEVICE_QUICK=1)")
    ap.add_argument("--checks", default=env("DEVICE_CHECKS"),
                    help=f"comma-separated subset of {','.join(CHECKS)} (default: DEVICE_CHECKS, else all; "
                         f"{','.join(QUICK_CHECKS)} with --quick)")
    ap.add_argument("--combos", default=env("DEVICE_COMBOS", ""),
                    help="lossless: only these drafter combinations, e.g. bf16-drafter (default: DEVICE_COMBOS, else all)")
    ap.add_argument("--budget-s", type=float, help="start no check or bench cell after this many seconds (default 480; 330 with --quick)")
    a = ap.parse_args(argv)
    checks = tuple(a.checks.split(",")) if a.checks else QUICK_CHECKS if a.quick else CHECKS
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        ap.error(f"unknown checks {unknown}; choose from {','.join(CHECKS)}")
    run = Run("device_check.json", budget_s=a.budget_s or (330 if a.quick else 480), section="checks")
    ctx = Ctx(run, a.quick, checks, tuple(c for c in a.combos.split(",") if c))
    run.results.update(gpu=device_name(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    run.step("fixtures", build_fixtures, ctx)
    if ctx.fix:
        for name in checks:
            label, fn = STEPS[name]
            run.step(label, fn, ctx)
    if "target" in ctx.fix:                              # for tests/test_exl3_gpu.py (not built by a MoE-only run)
        (run.path.parent / "pair").write_text(f"{ctx.fix['target']}:{ctx.fix['draft_bf16']}")
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
