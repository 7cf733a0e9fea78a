"""`python -m toolkit.bench`: speculative vs AR throughput over a prompt set, settings x concurrency, repeated.

Settings are plain AR, fixed block sizes B and `auto` (the drafting policy), and with --levers each named
exllamav3 lever as extra cells against stock settings, all in one process on the same jobs, so the speedup
compares like with like. With --reps N every cell runs once per repetition, repetition after repetition, and
each cell reports the median and spread (min/max, quartiles) of tok/s, t_round and t_AR (--minutes stops after the
last repetition that fits a time budget, so a long run on a rented GPU ends with a result). It reports tau (mean
accepted + 1 per verification round), per-position acceptance and losslessness (greedy output identical to AR);
with --timing-only (implied for synthetic checkpoints, whose acceptance means nothing) only the costs. With
--project-tau it projects, from the measured t_AR and t_round(w, c), the speedup at a given tau for exllamav3's
defaults (B-1 drafts every round) and for the policy's best width. It prints a table and writes bench.json and
bench.png into --out; each cell of bench.json holds its tok/s per repetition ("tok_s_reps"), and each `auto` cell
"costs": the policy's round costs per concurrency and width, the table it started from and the curve it had
learned at the cell's end (on exllamav3 also the rounds observed per width and "new_shape_excess_ms", what a
new (jobs, width) shape's warm-up rounds took beyond steady ones), and "auto_over_best_fixed": its tok/s over
the best fixed block's (by median) in each repetition, paired because both ran in it (median, min-max printed).
Speedups follow the one ratio rule of generate and the app
(benchmark/ratio.py): a cell where fewer than 1 decode round in 10 drafted over all repetitions (an `auto` cell the
policy ran as plain AR) has none ("speedup" null, "speedup_reason" says why); every other cell's is the ratio of
the repetition with the median spec/AR ratio ("pair": that repetition and its two tok/s, printed beside it), with
"spread"."speedup" the min-max over the repetitions.
Without --target/--draft it uses the shipped tiny pair. On the torch backend jobs run one after another (it has
no batching): use it for small models.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .assets.prompts import load_prompts, mixed
from .core.cli import check_values, entry, like, option, run
from .core.errors import OptionError, ToolkitError
from .core.folders import atomic_dir, claim
from .runtime.backend import GenSettings
from .benchmark import ratio
from .benchmark.grid import (  # noqa: F401
    Cell,
    best_per_concurrency,
    is_synthetic,
    job_list,
    project_cells,
    run_cell,
    run_grid,
    run_jobs,
)
from .mtp import is_mtp
from .runtime.factory import load_backend
from .runtime.registry import BACKENDS, capabilities, check_for_backend, levers
from .runtime.placement import DRAFT_HELP, SPLIT_HELP, TP_HELP, GpuSplit
from .benchmark.projection import ASSUMPTION, parse_taus

PROMPT_BUDGET = 1024        # prompt tokens per job the exllamav3 cache is sized for (see --cache-tokens)


def setting_name(c: dict) -> str:
    B = c.get("block_size")
    name = "AR" if B is None else ("auto" if B == "auto" else f"B={B}")
    return f"{name} +{c['lever']}" if c.get("lever") else name


def span(c: dict, key: str, fmt: str = "{:.1f}") -> str:
    """median [min-max] of a repeated measurement."""
    sp = c.get("spread", {}).get(key) or {}
    med = c.get(key) if key in c else sp.get("median")
    if med is None:
        return "-"
    if sp.get("n", 1) > 1:
        return f"{fmt.format(med)} [{fmt.format(sp['min'])}-{fmt.format(sp['max'])}]"
    return fmt.format(med)


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    ar = {c["concurrency"]: c for c in result["ar"]}
    timing = result.get("timing_only")
    reps = result.get("reps", 1)
    where = f" | {result['gpu_split']}" if result.get("gpu_split", "one GPU") != "one GPU" else ""
    cut = f" (of {result['reps_planned']}: --minutes ran out)" if result.get("reps_planned", reps) > reps else ""
    print(f"{result['backend']}{where} | {result['target']} + {result['draft']} | {reps} repetition(s){cut}, median [min-max]"
          + (" | timing only (synthetic weights: no tau, no losslessness)" if timing else ""), file=file)
    print(f"{'B':>4} {'conc':>5} {'tau':>6} {'spec tok/s':>11} {'AR tok/s':>10} {'speedup':>8} {'lossless':>9}  "
          "t_round ms | t_AR ms | widths | accept per position", file=file)
    if reps > 1:
        print("spec tok/s, AR tok/s and speedup: the repetition whose spec/AR ratio is the median (bench.json's "
              "\"pair\"; its \"tok_s\" is the median of the cell's own)", file=file)
    for c in result["cells"]:
        loss = "-" if c["lossless"] is None else f"{c['lossless']:.0%}"
        speed = "none" if c["speedup"] is None else f"{c['speedup']:.2f}x"
        pair = c.get("pair") or {"tok_s": c["tok_s"], "ar_tok_s": ar[c["concurrency"]]["tok_s"]}
        tau = "-" if c["tau"] is None else f"{c['tau']:.2f}"
        acc = " ".join(f"{a:.2f}" for a in c["accept_per_position"])
        B = c["block_size"]
        widths = ",".join(f"{w}:{n}" for w, n in c.get("width_histogram", {}).items()) if B == "auto" else ""
        print(f"{B:>4} {c['concurrency']:>5} {tau:>6} {pair['tok_s']:>11.1f} {pair['ar_tok_s']:>10.1f} "
              f"{speed:>8} {loss:>9}  {span(c, 'round_ms', '{:.2f}')} | {span(c, 't_ar_ms', '{:.2f}')} | "
              f"{widths} | {acc}" + (f"  [{c['lever']}]" if c.get("lever") else ""), file=file)
    print_ratio_notes(result, file)
    picks = [f"c={b['concurrency']}: " + (f"B={b['block_size']} ({b['speedup']:.2f}x)" if b["block_size"] else "AR (speculation slower)")
             + (f" +{b['lever']}" if b.get("lever") else "") for b in result.get("best", [])]
    if picks:
        print("fastest measured per concurrency: " + ", ".join(picks), file=file)
    paired = [f"c={c['concurrency']}{' +' + c['lever'] if c.get('lever') else ''}: {paired_ratio(p)} vs B={p['block_size']}"
              for c in result["cells"] if (p := c.get("auto_over_best_fixed"))]
    if paired:
        print("auto / best fixed block, paired per repetition, median (min-max): " + ", ".join(paired), file=file)
    print_projection(result.get("projection"), file)


def print_ratio_notes(result: dict, file) -> None:
    """Why a cell shows no speedup, and how far each speedup moved between repetitions (or that it was not measured)."""
    for c in result["cells"]:
        if c["speedup"] is None:
            print(f"no ratio, {setting_name(c)} c={c['concurrency']}: {c.get('speedup_reason')}", file=file)
    spreads = [f"{setting_name(c)} c={c['concurrency']}: {sp['min']:.2f}-{sp['max']:.2f}x"
               for c in result["cells"] if (sp := c.get("spread", {}).get("speedup"))]
    if spreads:
        print("speedup per repetition, min-max: " + ", ".join(spreads), file=file)
    elif result.get("reps", 1) == 1 and any(c["speedup"] is not None for c in result["cells"]):
        print("one repetition: each speedup above comes from a single run of each setting, with no spread measured; "
              "pass --reps 5 or more before reading it as a result", file=file)


def mark_ratios(ar_cells: list[dict], cells: list[dict]) -> None:
    """Each cell's speedup by the one ratio rule (benchmark/ratio.py): none, with the reason, when too few of its
    decode rounds drafted over all repetitions; else the ratio of the repetition with the median spec/AR ratio
    (both ran in it), whose tok/s go in "pair", and the min-max over the repetitions in "spread"."""
    ar = {a["concurrency"]: a for a in ar_cells}
    for c in cells:
        hist, reps = c.get("width_histogram", {}), len(c["tok_s_reps"])
        why = ratio.no_ratio(sum(n for w, n in hist.items() if int(w)), sum(hist.values()), reps)
        ar_reps = ar[c["concurrency"]]["tok_s_reps"]
        speed = ratio.paired(c["tok_s_reps"], ar_reps, why)
        c.update(speedup=speed.value, speedup_reason=speed.reason)
        k = ratio.median_pair(c["tok_s_reps"], ar_reps)
        if k is not None:
            c["pair"] = {"rep": k, "tok_s": c["tok_s_reps"][k], "ar_tok_s": ar_reps[k]}
        if speed.low is not None:
            ratios = [s / a for s, a in zip(c["tok_s_reps"], ar_reps) if s > 0 and a > 0]
            c.setdefault("spread", {})["speedup"] = {"min": speed.low, "max": speed.high, "n": speed.n, "ratios": ratios}


def paired_ratio(p: dict) -> str:
    return f"{p['median']:.3f}" + (f" ({p['min']:.3f}-{p['max']:.3f})" if p["n"] > 1 else "")


def print_projection(proj: dict | None, file) -> None:
    if not proj:
        return
    print(f"projection ({proj['assumption']}):", file=file)
    for r in proj["rows"]:
        print(f"  {r['setting']:<12} c={r['concurrency']:<3} {r['name']} (tau {r['tau']:g}, B={r['block_size']}, alpha {r['alpha']:.3f}): "
              f"defaults w={r['default_width']} {r['default_speedup']:.2f}x AR | policy w={r['policy_width']} "
              f"{r['policy_speedup']:.2f}x AR | policy/defaults {r['policy_over_default']:.2f}x"
              + (" (t_round at B-1 extrapolated)" if r["extrapolated"] else ""), file=file)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing = result.get("timing_only")
    proj = [r for r in (result.get("projection") or {}).get("rows", []) if r["setting"] == "stock"]
    panels = 1 + (not timing) + bool(proj)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    axes = list(axes) if panels > 1 else [axes]
    a = axes[0]
    key = "round_ms" if timing else "tok_s"
    groups: dict[str, list[dict]] = {"AR": result["ar"]}
    for c in result["cells"]:
        groups.setdefault(setting_name(c), []).append(c)
    for name, cells in groups.items():
        ys = [c[key] for c in cells]
        sp = [c.get("spread", {}).get(key) or {} for c in cells]
        lo = [y - s["min"] if s.get("min") is not None else 0.0 for y, s in zip(ys, sp)]
        hi = [s["max"] - y if s.get("max") is not None else 0.0 for y, s in zip(ys, sp)]
        a.errorbar([c["concurrency"] for c in cells], ys, yerr=[lo, hi], fmt="k--o" if name == "AR" else "-o", capsize=3, label=name)
    a.set_xscale("log", base=2)
    a.set(xlabel="concurrent jobs", ylabel="ms per decode round" if timing else "tokens / s (all jobs)",
          title=("round cost" if timing else "throughput") + f" (median, min-max of {result.get('reps', 1)})")
    if not timing:
        b = axes[1]
        for c in result["cells"]:
            first = next(x for x in result["cells"] if x["block_size"] == c["block_size"] and x.get("lever") == c.get("lever"))
            if c is first and c["accept_per_position"] and not c.get("lever"):
                b.plot(range(1, len(c["accept_per_position"]) + 1), c["accept_per_position"], "-o",
                       label=f"{setting_name(c)} (conc {c['concurrency']}, tau {c['tau']:.2f})")
        b.set(xlabel="draft position", ylabel="P(accepted | verified)", ylim=(0, 1.05), title="per-position acceptance")
    if proj:
        p = axes[-1]
        labels = [f"c={r['concurrency']}\n{r['name']}" for r in proj]
        xs = range(len(proj))
        p.bar([x - 0.2 for x in xs], [r["default_speedup"] for r in proj], 0.4, label="exllamav3 defaults (w = B-1)")
        p.bar([x + 0.2 for x in xs], [r["policy_speedup"] for r in proj], 0.4, label="policy (best w)")
        p.axhline(1.0, color="k", lw=0.8)
        p.set_xticks(list(xs), labels, fontsize=7)
        p.set(ylabel="projected speedup over AR", title="projection at tau (geometric acceptance)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['backend']}: {Path(result['target']).name} + {Path(result['draft']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_inputs(block_sizes, concurrency, limit, reps, **numbers) -> list:
    """The block sizes parsed; every number and the device against BenchOptions' domains (named by flag)."""
    try:
        blocks = GenSettings.parse_blocks(block_sizes)
    except OptionError as e:                       # bench() words its errors with the flags, also from Python
        raise ToolkitError(f"--block-sizes{e.rest}") from None
    if not concurrency:
        raise ToolkitError("--concurrency must be integers >= 1, got []")
    check_values(BenchOptions, {"concurrency": list(concurrency), "limit": limit, "reps": reps, **numbers})
    return blocks


def bench(o: BenchOptions) -> dict:
    """Run the grid of `o` (the command's options); returns the bench.json dict (also written, with bench.png,
    into `o.out`)."""
    target, draft, timing_only, cache_tokens = o.target, o.draft, o.timing_only, o.cache_tokens
    if target is None and draft is None:
        from .assets.pairs import tiny_pair

        target, draft = (str(p) for p in tiny_pair())
    if target is None or draft is None:
        raise ToolkitError("--target and --draft go together (the benchmark compares a drafter against AR)")
    blocks = check_inputs(o.block_sizes, o.concurrency, o.limit, o.reps, max_new_tokens=o.max_new_tokens,
                          temperature=o.temperature, seed=o.seed, device=o.device, cache_tokens=cache_tokens,
                          draft_device=o.draft_device, minutes=o.minutes)
    lv = levers(o.backend)
    if o.levers and lv is None:
        raise ToolkitError("--levers are exllamav3 generator options: use them with --backend exllamav3")
    lever_opts = [lv.parse_lever(x, lv.ADOPTED) for x in o.levers]
    taus = parse_taus(o.project_tau)
    split = GpuSplit.of(o.gpu_split, o.tensor_parallel, o.draft_device)
    check_for_backend(o.backend, split)
    try:
        settings = GenSettings(max_new_tokens=o.max_new_tokens, temperature=o.temperature, seed=o.seed)
    except ValueError as e:
        raise ToolkitError(str(e)) from None
    synthetic = is_synthetic(target, None if is_mtp(draft) else draft)
    timing_only = synthetic or bool(timing_only)   # synthetic weights: acceptance means nothing
    claim(o.out, "bench", o.force)                 # --out checked before any model is loaded
    items = load_prompts(o.prompts)
    if o.limit:
        items = mixed(items, o.limit)
    concs = sorted(set(o.concurrency))
    per_job = -(-(PROMPT_BUDGET + o.max_new_tokens + 17) // 256) * 256
    cache_tokens = cache_tokens or max(concs) * per_job
    be = load_backend(o.backend, target, draft, device=o.device or "cpu", cache_tokens=cache_tokens,
                      max_concurrency=max(concs), split=split)
    try:
        if be.block_size < 2:
            raise ToolkitError(f"{draft}: no drafter loaded, nothing to compare with AR")
        blocks = cut_blocks(blocks, be.block_size, timing_only)
        ids = [be.raw_encode(p.text) if o.raw else be.encode(p.text) for p in items]
        cells = grid_cells(blocks, concs, lever_opts)
        deadline = time.time() + o.minutes * 60 if o.minutes else None      # from here: loading is not counted
        ar_cells, spec_cells = run_grid(be, ids, settings, cells, o.reps, o.warmup, timing_only, o.quiet, deadline)
    finally:
        be.close()
    mark_ratios(ar_cells, spec_cells)
    result = {
        "backend": be.name, "target": str(target), "draft": str(draft), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(o.backend, o.device), "prompts": o.prompts or "builtin", "num_prompts": len(items),
        "categories": sorted({p.category for p in items}), "max_new_tokens": o.max_new_tokens, "temperature": o.temperature,
        "seed": o.seed, "raw": o.raw, "native_block_size": be.block_size, "block_sizes": blocks, "concurrency": concs,
        "cache_tokens": cache_tokens if be.caps.cache_tokens else None, "ar": ar_cells, "cells": spec_cells,
        "best": best_per_concurrency(ar_cells, [c for c in spec_cells if c["speedup"] is not None]), "reps": ar_cells[0]["reps"], "reps_planned": o.reps, "levers": [label for label, _ in lever_opts],
        "timing_only": timing_only, "synthetic": synthetic, "gpu_split": split.tag,
    }
    if taus:
        result["projection"] = {"assumption": ASSUMPTION, "taus": [{"name": n, "tau": t, "block_size": B} for n, t, B in taus],
                                "rows": project_cells(ar_cells, spec_cells, taus)}
    write_outputs(result, Path(o.out))
    if not o.quiet:
        print_table(result)
        print(f"wrote {Path(o.out) / 'bench.json'} and {Path(o.out) / 'bench.png'}", file=sys.stderr)
    return result


def grid_cells(blocks: list, concs: list[int], levers: list) -> list[Cell]:
    """AR per concurrency, then every setting per concurrency, then the same settings with each lever."""
    cells = [Cell(None, c) for c in concs] + [Cell(B, c) for B in blocks for c in concs]
    return cells + [Cell(B, c, label, opts) for label, opts in levers for B in blocks for c in concs]


def cut_blocks(block_sizes: list, native: int, timing_only: bool = False) -> list:
    """The asked block sizes cut to the drafter's own, without repeats (a note for each one cut); "auto" is kept
    unless only costs are measured (the policy's widths follow acceptance)."""
    blocks: list = []
    for B in block_sizes:
        if B == "auto" and timing_only:
            print("note: auto is left out of a timing-only run (its widths follow acceptance, meaningless here)", file=sys.stderr)
            continue
        eff = B if B == "auto" else min(B, native)
        if eff != B:
            print(f"note: block size {B} is cut to the drafter's {native}", file=sys.stderr)
        if eff not in blocks:
            blocks.append(eff)
    if not blocks:
        raise ToolkitError("nothing to measure: give --block-sizes with at least one integer for a timing-only run")
    return blocks


def device_name(backend: str, device: str | None) -> str:
    import torch

    if capabilities(backend).gpu_only or (device or "").startswith("cuda"):
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (unavailable)"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def write_outputs(result: dict, out: Path) -> None:
    """bench.json and bench.png, written in a temp folder beside `out` that replaces it only when both exist."""
    with atomic_dir(out, command="bench") as tmp:
        (tmp / "bench.json").write_text(json.dumps(result, indent=1))
        plot(result, tmp / "bench.png")


EXL3 = levers("exllamav3")         # the exllamav3 levers --levers names


@dataclass
class BenchOptions:
    target: str | None = option(None, "target model folder (default: the shipped tiny pair)")
    draft: str | None = option(None, "DFlash drafter folder (default: the shipped tiny pair), or mtp: the target's "
                               "own multi-token-prediction head (up to 4 drafts a round)")
    backend: str = option("torch", choices=list(BACKENDS))
    prompts: str | None = option(None, "prompt file: JSON lines with \"prompt\" (and \"category\"), or one prompt a line "
                                 "(default: built-in chat/code/math set)")
    block_sizes: list[str] = option(["auto", "8", "16"], "settings: auto (the drafting policy) and/or fixed verify widths B "
                                    "(default auto 8 16); B is cut to the drafter's own", metavar="auto|B")
    concurrency: list[int] = option([1, 4, 16, 32], "concurrent jobs (default 1 4 16 32)", lo=1)
    max_new_tokens: int = like(GenSettings, "max_new_tokens", 128)
    temperature: float = like(GenSettings, "temperature", help="0 = greedy (default; also reports losslessness)")
    seed: int = like(GenSettings, "seed")
    limit: int | None = option(None, "use only the first N prompts (mixed across categories)", lo=1)
    out: str = option("bench-out", "folder for bench.json and bench.png (default bench-out)")
    force: bool = option(False, "replace a non-empty --out that is not an earlier bench output")
    device: str | None = option(None, "torch device for the torch backend (default cpu)", kind="device")
    cache_tokens: int | None = option(None, f"exllamav3 cache size (default: max concurrency x ({PROMPT_BUDGET} + new "
                                      "tokens + 17), in pages of 256)", lo=256)
    warmup: bool = option(True, "an untimed warm-up wave before each cell; --no-warmup skips it")
    raw: bool = option(False, "tokenize prompts as is, without the chat template")
    quiet: bool = option(False, "no progress bar or table")
    reps: int = option(1, "repetitions; in each, the cells of a concurrency run wave by wave in turn (default 1; >= 10 for reported runs)", lo=1)
    levers: list[str] = option([], f"exllamav3 levers as extra cells against the toolkit's defaults ({EXL3.ADOPTED.tag}; "
                               "NAME=off turns one off, '+' joins several): "
                               + ", ".join(f"{k} (default {v})" for k, v in EXL3.LEVERS.items()), metavar="NAME[=VALUE]")
    project_tau: list[str] = option([], "project the speedup at these tau from the measured costs: published "
                                    "(Qwen3.6-35B-A3B DF-16 7.63, DF-8 5.74) or e.g. 7.63@16", metavar="published|TAU@B")
    timing_only: bool = option(False, "record costs only, no tau or losslessness (implied for synthetic checkpoints)")
    gpu_split: str | None = option(None, SPLIT_HELP, metavar="auto|GB,GB,...")
    tensor_parallel: bool = option(False, TP_HELP)
    draft_device: int = option(0, DRAFT_HELP, metavar="N", lo=0, hi=1023)
    minutes: float | None = option(None, "wall-clock budget for the repetitions: none starts that would not end "
                                   "within it (bench.json says how many ran); the models' loading is not counted",
                                   above=0, hi=1e6)


def main(argv: list[str] | None = None) -> None:
    run(lambda **kw: bench(BenchOptions(**kw)), BenchOptions, argv, "python -m toolkit.bench", __doc__.split("\n\n")[0],
        "Example (CPU, tiny pair): python -m toolkit.bench --concurrency 1 4 --max-new-tokens 32", output_policy=True)


if __name__ == "__main__":
    entry(main)
