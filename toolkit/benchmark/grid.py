"""The benchmark's grid: cells (AR, a fixed block, "auto", each with optional exllamav3 levers) x concurrency,
repeated rep by rep so that drift spreads over every cell, and the statistics and projections of the result.

A cell is one setting at one concurrency c: all its jobs run in waves of c (one after another on a backend that
does not batch). Each repetition runs every cell once, the cells of a concurrency interleaved wave by wave (each
wave in every cell before the next, their order rotating), so a slow stretch of the machine falls on every cell
alike; a cell reports the median and spread
of its tok/s, t_round (mean ms per decode round) and the t_AR of its concurrency over the repetitions, its tok/s
per repetition, and tau / acceptance / losslessness pooled over them. An `auto` cell also records its policy's
cost curves ("costs": the table it started from and the learned one after the cell's last repetition, ms per
width per concurrency; Policy.report) and, with fixed blocks beside it,
"auto_over_best_fixed": its tok/s over the best fixed block's (by median), repetition by repetition.
`python -m toolkit.bench` prints and plots it.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from tqdm import tqdm

from ..core.target import read_optional
from ..runtime import trace
from ..runtime.backend import Backend, GenSettings
from ..runtime.events import Round, summarize, tokens_of
from ..costs.table import CostTable, as_ms
from .projection import project, spread


@dataclass(frozen=True)
class Cell:
    """One setting at one concurrency: block None = plain AR, "auto" = the policy, N = fixed block."""

    block: int | str | None
    concurrency: int
    lever: str | None = None
    options: Any = None             # the backend's options (levers) for this cell; None: its defaults

    @property
    def ar(self) -> bool:
        return self.block is None


def run_jobs(backend: Backend, prompts: list[list[int]], settings: GenSettings, speculative: bool) -> tuple[list[list[Round]], float]:
    """Decode `prompts` as concurrent jobs (one after another on a backend that does not batch); (rounds per job, seconds)."""
    rounds: list[list[Round]] = [[] for _ in prompts]
    trace.emit("cell", label=f"{settings.block_size if speculative else 'ar'}/c{len(prompts)}/n{settings.max_new_tokens}")
    t0 = time.perf_counter()
    for i, r in backend.generate_many(prompts, settings, speculative=speculative):
        rounds[i].append(r)
    return rounds, time.perf_counter() - t0


def run_cell(backend: Backend, ids: list[list[int]], conc: int, settings: GenSettings, speculative: bool,
             warmup: bool) -> tuple[list[list[Round]], float]:
    """Jobs `ids` in waves of `conc`; the wall time excludes the optional warm-up wave (the first 8 tokens of the
    first wave)."""
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


def is_synthetic(*folders) -> bool:
    """Whether a checkpoint was written by toolkit.synth (random weights: acceptance means nothing)."""
    for f in folders:
        if f is not None and ((read_optional(Path(f) / "config.json").get("quantization_config") or {}).get("synthetic")):
            return True
    return False


def run_grid(be: Backend, ids: list[list[int]], settings: GenSettings, cells: list[Cell], reps: int = 1,
             warmup: bool = True, timing_only: bool = False, quiet: bool = True,
             deadline: float | None = None) -> tuple[list[dict], list[dict]]:
    """Every cell once per repetition, repetition after repetition: (AR cells, other cells checked against AR).
    With a `deadline` (time.time()) no repetition starts that the mean one so far would not finish before it; the
    cells then say how many ran (`reps`)."""
    runs: dict[Cell, list[tuple[list[list[Round]], float]]] = {c: [] for c in cells}
    costs: dict[Cell, dict] = {}              # auto cells: the policy's cost curves after the cell's last run
    paths: dict[Cell, dict] = {}              # the engine's kernel paths after the cell's last run (cumulative)
    bar = tqdm(total=reps * len(cells), desc="bench", disable=quiet, file=sys.stderr)
    t0 = time.time()
    groups = [[c for c in cells if c.concurrency == conc] for conc in dict.fromkeys(c.concurrency for c in cells)]

    def record(cell: Cell, st: GenSettings) -> None:
        """After a cell's last wave: the engine's kernel paths and an auto cell's cost curves."""
        engine = be.engine_report()
        if engine:
            paths[cell] = engine
        pol = be.auto_policy(st) if st.auto else None
        if pol is not None:
            costs[cell] = cost_report(pol)
            emitted = be.calibration_report()
            if emitted:                       # exllamav3, timed in this process: tokens a job emitted per round
                costs[cell]["calibration_tokens"] = emitted

    for rep in range(reps):
        if deadline is not None and rep and time.time() + (time.time() - t0) / rep > deadline:
            break
        for group in groups:
            conc = group[0].concurrency
            jobs = job_list(ids, conc)
            done = {cell: ([], 0.0) for cell in group}
            for k in range(0, len(jobs), conc):
                turn = (rep + k // conc) % len(group)
                for cell in group[turn:] + group[:turn]:          # wave by wave, the cells' order rotating
                    be.set_options(cell.options)
                    st = GenSettings(**{**vars(settings), "block_size": cell.block})
                    r, s = run_cell(be, jobs[k:k + conc], conc, st, speculative=not cell.ar, warmup=warmup and not k)
                    done[cell] = (done[cell][0] + r, done[cell][1] + s)
                    if k + conc >= len(jobs):
                        record(cell, st)
            for cell in group:
                runs[cell].append(done[cell])
                bar.update()
    bar.close()
    be.set_options(None)
    ar = {c.concurrency: c for c in cells if c.ar}
    ar_cells = {c: summarize_cell(c, runs[c], None, timing_only, settings.temperature) for c in ar.values()}
    out = [summarize_cell(c, runs[c], (ar_cells[ar[c.concurrency]], runs[ar[c.concurrency]]), timing_only,
                          settings.temperature) for c in cells if not c.ar]
    for c, stats in zip([c for c in cells if not c.ar], out):
        if c in costs:
            stats["costs"] = costs[c]
        if c in paths:
            stats["engine"] = paths[c]
    pair_auto(out)
    return list(ar_cells.values()), out


def cost_report(pol) -> dict:
    """An auto policy's cost curves (bench.json): {"start", "learned": {c: {w: ms}} for w = 0..B-1, interpolated
    between the table's widths; "observed": {c: {w: {ms, rounds}}}; "source"}, and its plain AR requests."""
    rc, b = pol.costs, pol.block_size
    cs = sorted(set(rc.table.ms) | {j for j, _ in rc.seen})
    now = {c: rc.curve(c) for c in cs}
    out = {"source": rc.table.source,
           "start": {c: as_ms(rc.table.curve(b, c)) for c in cs},
           "learned": {c: as_ms(CostTable({c: now[c]}).curve(b, c)) for c in cs},
           "observed": {c: {w: {"ms": round(now[c][w], 3), "rounds": len(d)}
                            for (j, w), d in sorted(rc.seen.items()) if j == c} for c in cs}}
    if pol.plain_served:
        out["plain_ar_requests"] = pol.plain_served
    return out


def pair_auto(cells: list[dict]) -> None:
    """Per concurrency and lever, `auto` over the best fixed block (by median tok/s) rep by rep: the two ran in the
    same repetition, so drift cancels. Stored in the auto cell as "auto_over_best_fixed" (ratios and their spread)."""
    for a in (x for x in cells if x["block_size"] == "auto"):
        same = [x for x in cells if isinstance(x["block_size"], int) and x["concurrency"] == a["concurrency"]
                and x.get("lever") == a.get("lever") and len(x["tok_s_reps"]) == len(a["tok_s_reps"])]
        if not same:
            continue
        best = max(same, key=lambda x: x["tok_s"])
        ratios = [u / v if v else 0.0 for u, v in zip(a["tok_s_reps"], best["tok_s_reps"])]
        a["auto_over_best_fixed"] = {"block_size": best["block_size"], "ratios": ratios, **spread(ratios)}


def summarize_cell(cell: Cell, runs: list, ar: tuple[dict, list] | None, timing_only: bool, temperature: float) -> dict:
    """Median of the repetitions (tok/s, t_round), their spread, tok/s per repetition in order ("tok_s_reps"), and
    tau / acceptance / losslessness pooled."""
    per_rep = [cell_stats(rounds, secs) for rounds, secs in runs]
    pooled = cell_stats([job for rounds, _ in runs for job in rounds], sum(s for _, s in runs))
    mid = sorted(per_rep, key=lambda s: s["tok_s"])[len(per_rep) // 2]
    tok_s_reps = [s["tok_s"] for s in per_rep]
    tok_s, round_ms = spread(tok_s_reps), spread([s["round_ms"] for s in per_rep])
    stats = {"concurrency": cell.concurrency, "jobs": len(runs[0][0]), **mid, "reps": len(runs),
             "tok_s": tok_s["median"], "tok_s_reps": tok_s_reps, "round_ms": round_ms["median"],
             "tau": pooled["tau"], "accept_per_position": pooled["accept_per_position"], "tau_histogram": pooled["tau_histogram"],
             "spread": {"tok_s": tok_s, "round_ms": round_ms}}
    widths = Counter(len(r.drafted) for rounds, _ in runs for job in rounds for r in job if not r.prefill)
    stats["width_histogram"] = {w: widths[w] for w in sorted(widths)}
    if timing_only:
        stats.update(tau=None, accept_per_position=[], tau_histogram={})
    if ar is None:
        return stats
    a, ar_runs = ar
    same = [tokens_of(t) == tokens_of(u) for (rs, _), (ars, _) in zip(runs, ar_runs) for t, u in zip(rs, ars)]
    stats.update(block_size=cell.block, ar_tok_s=a["tok_s"], speedup=stats["tok_s"] / a["tok_s"] if a["tok_s"] else 0.0,
                 lossless=(sum(same) / len(same)) if temperature == 0 and not timing_only else None,
                 t_ar_ms=a["round_ms"])
    stats["spread"]["t_ar_ms"] = a["spread"]["round_ms"]
    if cell.lever:
        stats.update(lever=cell.lever, options=cell.options.tag)
    return stats


def best_per_concurrency(ar_cells: list[dict], cells: list[dict]) -> list[dict]:
    """For each concurrency, the measured setting with the most tok/s: a block size, or plain AR when speculation loses."""
    out = []
    for a in ar_cells:
        c = a["concurrency"]
        spec = max((x for x in cells if x["concurrency"] == c), key=lambda x: x["tok_s"], default=None)
        if spec is not None and spec["tok_s"] > a["tok_s"]:
            pick = {"concurrency": c, "block_size": spec["block_size"], "speedup": spec["speedup"]}
            out.append({**pick, "lever": spec["lever"]} if spec.get("lever") else pick)
        else:
            out.append({"concurrency": c, "block_size": None, "speedup": 1.0})   # AR is at least as fast
    return out


def cost_tables(ar_cells: list[dict], cells: list[dict]) -> dict[str, CostTable]:
    """Per setting group (stock or a lever): t_round(w, c) from the fixed-block cells, w = 0 at the measured t_AR."""
    groups: dict[str, dict[int, dict[int, float]]] = {}
    t_ar = {a["concurrency"]: a["round_ms"] for a in ar_cells}
    for c in cells:
        if not isinstance(c["block_size"], int) or not c["round_ms"]:
            continue
        pts = groups.setdefault(c.get("lever") or "stock", {}).setdefault(c["concurrency"], {0: t_ar[c["concurrency"]]})
        pts[c["block_size"] - 1] = c["round_ms"]
    return {g: CostTable({c: p for c, p in ms.items() if len(p) > 1}) for g, ms in groups.items()
            if any(len(p) > 1 for p in ms.values())}


def project_cells(ar_cells: list[dict], cells: list[dict], taus: list[tuple[str, float, int]]) -> list[dict]:
    """The projected speedups (runtime/projection.project) per setting group, concurrency and tau; a tau whose
    default width B-1 was not measured at that concurrency is left out."""
    rows = []
    for group, table in cost_tables(ar_cells, cells).items():
        for c in sorted(table.ms):
            for name, tau, B in taus:
                if B - 1 not in table.ms[c]:
                    continue
                rows.append({"setting": group, "name": name, **project(table, c, tau, B)})
    return rows
