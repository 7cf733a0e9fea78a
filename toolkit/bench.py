"""`python -m toolkit.bench`: speculative vs AR throughput over a prompt set, block sizes x concurrency.

For each concurrency c the AR baseline (same target, same cache, no drafter) runs once, then each block size
B runs speculatively on the same jobs, all in one process, so the speedup compares like with like. Reports
tau (mean accepted + 1 per verification round), per-position acceptance, tok/s of both and the speedup,
prints a table and writes bench.json and bench.png into --out. Without --target/--draft it uses the shipped
tiny pair. On the torch backend jobs run one after another (it has no batching): use it for small models.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from .assets.prompts import load_prompts
from .core.errors import ToolkitError, run_cli
from .runtime.backend import Backend, GenSettings
from .runtime.events import Round, summarize, tokens_of
from .runtime.factory import load_backend

PROMPT_BUDGET = 1024        # prompt tokens per job the exllamav3 cache is sized for (see --cache-tokens)


def run_jobs(backend: Backend, prompts: list[list[int]], settings: GenSettings, speculative: bool) -> tuple[list[list[Round]], float]:
    """Decode `prompts` as concurrent jobs (one after another on a backend that does not batch); (rounds per job, seconds)."""
    rounds: list[list[Round]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for i, r in backend.generate_many(prompts, settings, speculative=speculative):
        rounds[i].append(r)
    return rounds, time.perf_counter() - t0


def run_cell(backend: Backend, ids: list[list[int]], conc: int, settings: GenSettings, speculative: bool,
             warmup: bool) -> tuple[list[list[Round]], float]:
    """All jobs of one cell in waves of `conc`; the wall time excludes the optional warm-up wave."""
    if warmup:
        run_jobs(backend, ids[:conc], GenSettings(**{**vars(settings), "max_new_tokens": min(8, settings.max_new_tokens)}), speculative)
    rounds: list[list[Round]] = []
    secs = 0.0
    for k in range(0, len(ids), conc):
        r, s = run_jobs(backend, ids[k:k + conc], settings, speculative)
        rounds += r
        secs += s
    return rounds, secs


def cell_stats(rounds: list[list[Round]], secs: float) -> dict:
    flat = [r for job in rounds for r in job]
    s = summarize(flat, secs)
    decode = [r for r in flat if not r.prefill]
    return {
        "tokens": s.tokens, "seconds": secs, "tok_s": s.tok_s, "tau": s.tau, "rounds": len(decode),
        "accept_per_position": s.accept_per_position, "tau_histogram": s.tau_histogram,
        "round_ms": sum(r.t_draft_ms + r.t_verify_ms for r in decode) / len(decode) if decode else 0.0,
        "draft_ms": sum(r.t_draft_ms for r in decode) / len(decode) if decode else 0.0,
    }


def job_list(ids: list[list[int]], conc: int) -> list[list[int]]:
    """At least `conc` jobs and at least one per prompt, a whole number of waves, prompts cycled."""
    n = max(conc, len(ids))
    n = -(-n // conc) * conc
    return [ids[j % len(ids)] for j in range(n)]


def best_per_concurrency(ar_cells: list[dict], cells: list[dict]) -> list[dict]:
    """For each concurrency, the measured setting with the most tok/s: a block size, or plain AR when speculation loses."""
    out = []
    for a in ar_cells:
        c = a["concurrency"]
        spec = max((x for x in cells if x["concurrency"] == c), key=lambda x: x["tok_s"], default=None)
        if spec is not None and spec["tok_s"] > a["tok_s"]:
            out.append({"concurrency": c, "block_size": spec["block_size"], "speedup": spec["speedup"]})
        else:
            out.append({"concurrency": c, "block_size": None, "speedup": 1.0})   # AR is at least as fast
    return out


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    ar = {c["concurrency"]: c for c in result["ar"]}
    print(f"{result['backend']} | {result['target']} + {result['draft']}", file=file)
    head = f"{'B':>3} {'conc':>5} {'tau':>6} {'spec tok/s':>11} {'AR tok/s':>10} {'speedup':>8} {'lossless':>9}  accept per position"
    print(head, file=file)
    for c in result["cells"]:
        loss = "-" if c["lossless"] is None else f"{c['lossless']:.0%}"
        acc = " ".join(f"{a:.2f}" for a in c["accept_per_position"])
        print(f"{c['block_size']:>3} {c['concurrency']:>5} {c['tau']:>6.2f} {c['tok_s']:>11.1f} "
              f"{ar[c['concurrency']]['tok_s']:>10.1f} {c['speedup']:>7.2f}x {loss:>9}  {acc}", file=file)
    picks = [f"c={b['concurrency']}: " + (f"B={b['block_size']} ({b['speedup']:.2f}x)" if b["block_size"] else "AR (speculation slower)")
             for b in result.get("best", [])]
    if picks:
        print("fastest measured per concurrency: " + ", ".join(picks), file=file)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    concs = [c["concurrency"] for c in result["ar"]]
    a.plot(concs, [c["tok_s"] for c in result["ar"]], "k--o", label="AR")
    for B in result["block_sizes"]:
        cells = [c for c in result["cells"] if c["block_size"] == B]
        a.plot([c["concurrency"] for c in cells], [c["tok_s"] for c in cells], "-o", label=f"DFlash B={B}")
        first = cells[0]
        b.plot(range(1, len(first["accept_per_position"]) + 1), first["accept_per_position"], "-o",
               label=f"B={B} (conc {first['concurrency']}, tau {first['tau']:.2f})")
    a.set_xscale("log", base=2)
    a.set(xlabel="concurrent jobs", ylabel="tokens / s (all jobs)", title="throughput")
    b.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1.05), title="per-position acceptance")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['backend']}: {Path(result['target']).name} + {Path(result['draft']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench(
    target: str | None = None,
    draft: str | None = None,
    backend: str = "torch",
    prompts: str | None = None,
    block_sizes: list[int] = (8, 16),
    concurrency: list[int] = (1, 4, 16, 32),
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    limit: int | None = None,
    out: str = "bench-out",
    device: str | None = None,
    cache_tokens: int | None = None,
    warmup: bool = True,
    raw: bool = False,
    quiet: bool = False,
) -> dict:
    """Run the grid; returns the bench.json dict (also written, with bench.png, into `out`)."""
    if target is None and draft is None:
        from .assets.pairs import tiny_pair

        target, draft = (str(p) for p in tiny_pair())
    if target is None or draft is None:
        raise ToolkitError("--target and --draft go together (the benchmark compares a drafter against AR)")
    if not block_sizes or any(b < 2 for b in block_sizes):
        raise ToolkitError(f"--block-sizes must be integers >= 2, got {list(block_sizes)}")
    if not concurrency or any(c < 1 for c in concurrency):
        raise ToolkitError(f"--concurrency must be integers >= 1, got {list(concurrency)}")
    if limit is not None and limit < 1:
        raise ToolkitError(f"--limit must be >= 1, got {limit}")
    try:
        settings = GenSettings(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    except ValueError as e:
        raise ToolkitError(str(e)) from None
    items = load_prompts(prompts)
    if limit:                                  # round-robin over categories so a short run still mixes them
        cats = sorted({p.category for p in items}, key=[p.category for p in items].index)
        order = [p for k in range(len(items)) for c in cats for p in [q for q in items if q.category == c][k:k + 1]]
        items = order[:limit]
    concs = sorted(set(concurrency))
    per_job = -(-(PROMPT_BUDGET + max_new_tokens + max(block_sizes) + 1) // 256) * 256
    cache_tokens = cache_tokens or max(concs) * per_job
    be = load_backend(backend, target, draft, device=device or "cpu", cache_tokens=cache_tokens, max_concurrency=max(concs))
    try:
        if be.block_size < 2:
            raise ToolkitError(f"{draft}: no drafter loaded, nothing to compare with AR")
        blocks = cut_blocks(block_sizes, be.block_size)
        ids = [be.raw_encode(p.text) if raw else be.encode(p.text) for p in items]
        ar_cells, cells = run_grid(be, ids, settings, blocks, concs, warmup, quiet)
    finally:
        be.close()
    result = {
        "backend": be.name, "target": str(target), "draft": str(draft), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(backend, device), "prompts": prompts or "builtin", "num_prompts": len(items),
        "categories": sorted({p.category for p in items}), "max_new_tokens": max_new_tokens, "temperature": temperature,
        "seed": seed, "raw": raw, "native_block_size": be.block_size, "block_sizes": blocks, "concurrency": concs,
        "cache_tokens": cache_tokens if backend == "exllamav3" else None, "ar": ar_cells, "cells": cells,
        "best": best_per_concurrency(ar_cells, cells),
    }
    write_outputs(result, Path(out))
    if not quiet:
        print_table(result)
        print(f"wrote {Path(out) / 'bench.json'} and {Path(out) / 'bench.png'}", file=sys.stderr)
    return result


def cut_blocks(block_sizes: list[int], native: int) -> list[int]:
    """The asked block sizes cut to the drafter's own, without repeats (a note for each one cut)."""
    blocks: list[int] = []
    for B in block_sizes:
        eff = min(B, native)
        if eff != B:
            print(f"note: block size {B} is cut to the drafter's {native}", file=sys.stderr)
        if eff not in blocks:
            blocks.append(eff)
    return blocks


def run_grid(be: Backend, ids: list[list[int]], settings: GenSettings, blocks: list[int], concs: list[int], warmup: bool,
             quiet: bool) -> tuple[list[dict], list[dict]]:
    """AR once per concurrency, then every block size on the same jobs: (AR cells, speculative cells checked against AR)."""
    ar_cells, cells = [], []
    grid = [(None, c) for c in concs] + [(B, c) for B in blocks for c in concs]
    ar_tokens: dict[int, list[list[int]]] = {}
    for B, c in tqdm(grid, desc="bench", disable=quiet, file=sys.stderr):
        jobs = job_list(ids, c)
        st = GenSettings(**{**vars(settings), "block_size": B})
        rounds, secs = run_cell(be, jobs, c, st, speculative=B is not None, warmup=warmup)
        stats = {"concurrency": c, "jobs": len(jobs), **cell_stats(rounds, secs)}
        toks = [tokens_of(r) for r in rounds]
        if B is None:
            ar_tokens[c] = toks
            ar_cells.append(stats)
            continue
        ar = next(a for a in ar_cells if a["concurrency"] == c)
        same = [t == a for t, a in zip(toks, ar_tokens[c])]
        stats.update(block_size=B, ar_tok_s=ar["tok_s"], speedup=stats["tok_s"] / ar["tok_s"] if ar["tok_s"] else 0.0,
                     lossless=(sum(same) / len(same)) if settings.temperature == 0 else None)
        cells.append(stats)
    return ar_cells, cells


def device_name(backend: str, device: str | None) -> str:
    import torch

    if backend == "exllamav3" or (device or "").startswith("cuda"):
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (unavailable)"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def write_outputs(result: dict, out: Path) -> None:
    """bench.json and bench.png, written in a temp folder beside `out` and moved in only when both exist."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "bench.json").write_text(json.dumps(result, indent=1))
        plot(result, tmp / "bench.png")
        out.mkdir(exist_ok=True)
        for name in ("bench.json", "bench.png"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toolkit.bench", description=__doc__.split("\n\n")[0],
                                 epilog="Example (CPU, tiny pair): python -m toolkit.bench --concurrency 1 4 --max-new-tokens 32")
    ap.add_argument("--target", help="target model folder (default: the shipped tiny pair)")
    ap.add_argument("--draft", help="DFlash drafter folder (default: the shipped tiny pair)")
    ap.add_argument("--backend", default="torch", choices=["torch", "exllamav3"])
    ap.add_argument("--prompts", help="prompt file: JSON lines with \"prompt\" (and \"category\"), or one prompt a line (default: built-in chat/code/math set)")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16], help="verify widths B (default 8 16); cut to the drafter's own")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32], help="concurrent jobs (default 1 4 16 32)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; also reports losslessness)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, help="use only the first N prompts (mixed across categories)")
    ap.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png (default bench-out)")
    ap.add_argument("--device", help="torch device for the torch backend (default cpu)")
    ap.add_argument("--cache-tokens", type=int, help=f"exllamav3 cache size (default: max concurrency x ({PROMPT_BUDGET} + new tokens + B), in pages of 256)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up wave before each cell")
    ap.add_argument("--raw", action="store_true", help="tokenize prompts as is, without the chat template")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or table")
    bench(**vars(ap.parse_args(argv)))


if __name__ == "__main__":
    run_cli(main)
