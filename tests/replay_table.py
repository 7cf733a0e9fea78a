"""The policy replay's scenarios and its table: `auto`, its rivals and its ablation on every committed trace.

A scenario is a device trace (tests/data/replay/costs_h100_*.json.gz, named as its experiments/results/traces/
file: the date and UTC time its bench started, or `noisy`, `1207`, `1207c`) at the concurrencies its bench ran, over
the SmolLM2 pair's full-width lengths; `useless` replays 1206-1042's costs with a drafter that accepts nothing and
AR rounds of the speculative engine 20 % dearer than plain steps; `switch` 4 requests where the drafter accepts
nothing, then 4 where it works, `drop` the reverse (c=4); `fresh` replays 1206-1042 at c=1 with a new policy for
every request (all 8 prompts), as every `generate` run and app turn starts. Every mode runs on common draws (tests/replay.py) beside AR
and every fixed width the calibration times; a cell is the mean over seeds of each mode's paired median ratio over
the best of those fixed widths and over AR.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
from collections.abc import Callable

from tests import replay as R

LENGTHS = R.load(R.DATA / "lengths_smollm2.json.gz")
FIRST4 = dict(LENGTHS, prompts=LENGTHS["prompts"][:4])      # the bench's --limit 4 runs
USELESS = dict(FIRST4, prompts=[dict(p, lengths=[0] * len(p["lengths"])) for p in FIRST4["prompts"]])
SWITCH = dict(FIRST4, prompts=USELESS["prompts"] + FIRST4["prompts"])    # useless on 4 requests, then good on 4
DROP = dict(FIRST4, prompts=FIRST4["prompts"] + USELESS["prompts"])      # good on 4 requests, then useless on 4
# name -> (lengths, costs file, concurrencies, noise in time, AR rounds of a speculative request over plain ones,
# a fresh policy per request)
SCENARIOS = {"1206-1042": (FIRST4, "1206-1042", [1, 4, 8], False, 1.0, False),
             "1206-1049": (LENGTHS, "1206-1049", [4, 8], False, 1.0, False),
             "1206-1121": (LENGTHS, "1206-1121", [4, 8], False, 1.0, False),
             "1206-0942": (FIRST4, "1206-0942", [1, 4, 8], False, 1.0, False),
             "1206-0952": (FIRST4, "1206-0952", [1], False, 1.0, False), "noisy": (FIRST4, "noisy", [1, 4, 8], True, 1.0, False),
             "1207": (FIRST4, "1207", [1, 4, 8], True, 1.0, False), "1207c": (FIRST4, "1207c", [1, 4, 8], True, 1.0, False),
             "useless": (USELESS, "1206-1042", [1, 4, 8], False, 1.2, False), "switch": (SWITCH, "1206-1042", [1], False, 1.0, False),
             "drop": (DROP, "1206-1042", [4], False, 1.0, False), "fresh": (LENGTHS, "1206-1042", [1], False, 1.0, True),
             "poisoned": (SWITCH, "1206-1042", [1], False, 1.0, False)}
# a busy machine: `poisoned`'s table was timed under load (the AR step x5, drafting widths x5, the 1-draft round
# x8: out of order), and a load burst (x4) meets the first rounds after the warm-up wave
LOADS = {"poisoned": R.Load({0: 5.0, 1: 8.0, -1: 5.0}, burst_from=8, burst_to=12, burst=4.0)}
FIXED = {"ar": 0, **{f"w{w}": w for w in (1, 3, 5, 7, 11, 15)}}     # the calibration's widths (timed, traced)
COSTS = {name: R.load(R.DATA / f"costs_h100_{name}.json.gz") for name in {s[1] for s in SCENARIOS.values()}}

Cells = dict[tuple[str, int], dict[str, tuple[float, float]]]


_MODES: dict[str, int | R.Factory] = {}     # the modes of the running evaluate(), inherited by forked workers


def draw(task: tuple[str, int, int]) -> dict:
    """One scenario's ratios on one seed's cost draws (R.ratios)."""
    name, seed, reps = task
    lengths, costs, cs, noise, spec_ar, fresh = SCENARIOS[name]
    return R.ratios(R.run_modes(lengths, COSTS[costs], cs, {**FIXED, **_MODES}, reps=reps, seed=seed,
                                timed_noise=noise, spec_ar=spec_ar, fresh=fresh, load=LOADS.get(name)),
                    [m for m in FIXED if m != "ar"])


def evaluate(modes: dict[str, int | R.Factory], scenarios: list[str] | None = None, seeds: int = 4,
             reps: int = 8) -> Cells:
    """{(scenario, c): {mode: (over the best fixed width, over AR)}, "best": the best fixed width}. Seeds run in
    forked workers, one per core (pure Python: the replay is CPU-bound and every draw is independent)."""
    names = scenarios or list(SCENARIOS)
    tasks = [(n, s, reps) for n in names for s in range(seeds)]
    _MODES.clear()
    _MODES.update(modes)
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, len(tasks))
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = pool.map(draw, tasks, chunksize=1)
    else:
        done = [draw(t) for t in tasks]
    out: Cells = {}
    for name in names:
        _, _, cs, _, _, _ = SCENARIOS[name]
        runs = [r for (n, _, _), r in zip(tasks, done) if n == name]
        for c in cs:
            cell = {m: (statistics.mean(r[c][m]["over_best"] for r in runs), statistics.mean(r[c][m]["over_ar"] for r in runs))
                    for m in modes}
            cell["best"] = statistics.mode(r[c]["best"] for r in runs)
            out[(name, c)] = cell
    return out


def target(name: str, cell: tuple[float, float]) -> bool:
    """Whether a mode's cell meets the target: >= 0.97 of the best fixed width, >= 0.98 of AR for `useless`."""
    return cell[1] >= 0.98 if name == "useless" else cell[0] >= 0.97


def verdict(cells: Cells, base: str, off: str) -> tuple[float, float, list[str]]:
    """(largest gain of `base` over `off`, largest loss, the cells where `base` meets the target and `off` not)."""
    d = [cells[k][base][0] / cells[k][off][0] - 1 for k in cells]
    held = [f"{n} c={c}" for (n, c), v in cells.items() if target(n, v[base]) and not target(n, v[off])]
    return max(d), -min(d), held


def markdown(cells: Cells, rows: dict[str, str], base: str = "auto") -> str:
    """One row per mode: its ratio over the best fixed width in every cell (over AR for `useless`), and for an
    ablation row how much `base` gains and loses against it and the target cells only `base` holds."""
    keys = list(cells)
    head = ["mode"] + [f"{n} c={c}" for n, c in keys] + ["`auto` gains / loses; target cells only it holds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, label in rows.items():
        vals = [cells[k][m][1 if k[0] == "useless" else 0] for k in keys]
        v = ""
        if m.startswith("-"):
            g, loss, held = verdict(cells, base, m)
            v = f"+{100 * g:.1f} % / -{100 * max(0.0, loss):.1f} %" + (f"; holds {len(held)}" if held else "")
        lines.append("| " + " | ".join([label] + [f"{x:.3f}" for x in vals] + [v]) + " |")
    best = "| best fixed width | " + " | ".join(cells[k]["best"].lstrip("w") if k[0] != "useless" else "AR" for k in keys) + " | |"
    return "\n".join(lines[:2] + [best] + lines[2:])


SPECIAL = ("useless", "switch", "drop", "fresh")          # the scenarios that are not a bench trace as it ran


def summary(cells: Cells, rows: dict[str, str], base: str = "auto") -> str:
    """The results page's compact form of markdown(): per mode, the range of its cells over the bench traces at each
    concurrency, the special scenarios, and for an ablation row what `base` gains and loses against it."""
    traces = [k for k in cells if k[0] not in SPECIAL]
    cs = sorted({c for _, c in traces})
    head = (["mode"] + [f"traces c={c}" for c in cs] + ["`useless` (of AR)", "`switch`", "`drop`", "`fresh`",
            "`auto` gains / loses; target cells only it holds"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def span(keys: list[tuple[str, int]], m: str, i: int) -> str:
        vals = [cells[k][m][i] for k in keys]
        return f"{min(vals):.3f}" if min(vals) == max(vals) else f"{min(vals):.3f}-{max(vals):.3f}"

    for m, label in rows.items():
        vals = [span([k for k in traces if k[1] == c], m, 0) for c in cs]
        vals.append(span([k for k in cells if k[0] == "useless"], m, 1))
        vals += [span([k for k in cells if k[0] == name], m, 0) for name in SPECIAL[1:]]
        v = ""
        if m.startswith("-"):
            g, loss, held = verdict(cells, base, m)
            v = f"+{100 * g:.1f} % / -{100 * max(0.0, loss):.1f} %" + (f"; holds {len(held)}" if held else "")
        lines.append("| " + " | ".join([label] + vals + [v]) + " |")
    return "\n".join(lines)


def modes_of(rows: dict[str, tuple[str, Callable]]) -> dict[str, R.Factory]:
    return {m: f for m, (_, f) in rows.items()}
