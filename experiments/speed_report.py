"""`python -m experiments.speed_report`: the Markdown tables of docs/performance.md (issue 16), rendered from the
raw JSON that `python -m experiments.speed` wrote on the device (committed under docs/speed_<date>/).

Nothing runs on the device. The tables are: round costs per call, concurrency, setting and width (median over the
interleaved repetitions, with min-max); the AR round of the speculative Generator against plain AR; the projected
speedup at the published tau (exllamav3's default width vs the policy's); the torch.profiler comparison at c=1,
w=7; the SmolLM2 pair's measured tok/s; its targets (auto / best fixed as the paired ratio per repetition,
median (min-max), where bench.json has it; older files: the ratio of medians); and a list of the derived numbers
the prose quotes.
Every number is read from the files or computed here from them, so `--check DOC` can verify that a document still
holds the tables verbatim (tests/test_speed_report.py does that for docs/performance.md).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from statistics import median

from toolkit.core.errors import ToolkitError, run_cli
from toolkit.core.folders import read_json

DATED = Path("docs/speed_2026-12-03")
SHAPES = ("shape_call5_c1c4.json", "shape_call6_c8c16.json", "shape_call2.json")
PAIR = "pair_bench.json"
ROWS_LEVER = "draft_max_rows"      # trims the window itself: the width asked for is not the width verified


# -- reading ---------------------------------------------------------------------------------------------------


def label(path: Path) -> str:
    m = re.search(r"call(\d+)", path.stem)
    return f"call {m.group(1)}" if m else path.stem


def load_shapes(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        d = read_json(p, "--shape ", "no such file")
        if d.get("mode") != "shape" or "timing" not in d:
            raise ToolkitError(f"--shape {p}: not a `speed shape` result (no timing)")
        out.append({"label": label(p), **d})
        for r in (d.get("projection") or {}).get("rows", []):
            plain_ar_floor(r)
    return out


def plain_ar_floor(r: dict) -> None:
    """A projection row as today's projection gives it: since 2026-12-06 the policy decodes plain AR (1.0x) where
    no round beats a plain AR step; rows of earlier runs could project below 1.0x."""
    if r.get("plain_ar") is None and r["policy_speedup"] < 1.0:
        r.update(policy_width=0, policy_round_ms=r["t_ar_ms"], policy_speedup=1.0,
                 policy_over_default=1.0 / r["default_speedup"], plain_ar=True)


def load_pair(path: Path) -> dict:
    d = read_json(path, "--pair ", "no such file")
    if "cells" not in d or "ar" not in d:
        raise ToolkitError(f"--pair {path}: not a toolkit.bench result (no cells)")
    return d


# -- formatting ------------------------------------------------------------------------------------------------


def num(x: float | None, d: int = 1) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def cell(s: dict | None, d: int = 1) -> str:
    """A spread as `median (min-max)`, or the value alone when there is one repetition."""
    if not s or not s.get("n"):
        return "-"
    if s["n"] == 1:
        return num(s["median"], d)
    return f"{num(s['median'], d)} ({num(s['min'], d)}-{num(s['max'], d)})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def is_rows_lever(setting: str) -> bool:
    return setting.split("=")[0] == ROWS_LEVER


# -- real shape ------------------------------------------------------------------------------------------------


def rounds_table(shapes: list[dict]) -> str:
    """t_AR and t_round(w) per call, c and setting: median (min-max) over the repetitions."""
    widths = shapes[0]["timing"]["widths"]
    rows = []
    for d in shapes:
        t = d["timing"]
        for c in map(str, t["concurrency"]):
            for s in t["settings"]:
                per = t["round_ms"][s][c]
                rows.append([d["label"], c, s, str(t["reps_done"]), cell(t["ar_ms"][c]) if s == "stock" else "",
                             *[cell(per.get(str(w))) for w in widths]])
    return table(["call", "c", "setting", "reps", "t_AR ms", *[f"w={w} ms" for w in widths]], rows)


def ar_round_table(shapes: list[dict]) -> str:
    """An AR round of the speculative Generator (w = 0, stock) against the drafter-less Generator's AR step."""
    rows = []
    for d in shapes:
        t = d["timing"]
        for c in map(str, t["concurrency"]):
            ar, w0 = t["ar_ms"][c]["median"], t["round_ms"]["stock"][c]["0"]["median"]
            rows.append([d["label"], c, str(t["reps_done"]), num(ar, 2), num(w0, 2), num(d["ar_in_spec_over_ar"][c], 2)])
    return table(["call", "c", "reps", "t_AR ms (median)", "AR round with drafter ms (median)", "ratio"], rows)


def projection_table(shapes: list[dict]) -> str:
    """Projected speedups over AR at the published tau, per call, c, setting and tau."""
    rows = []
    for d in shapes:
        prj = d["projection"]["rows"]
        stock = {(r["concurrency"], r["name"]): r for r in prj if r["setting"] == "stock"}
        for r in sorted(prj, key=lambda r: (r["concurrency"], r["name"], r["setting"] != "stock")):
            base = stock.get((r["concurrency"], r["name"]))
            head = [d["label"], str(r["concurrency"]), r["setting"], f"{r['name']} ({r['tau']})"]
            if is_rows_lever(r["setting"]):
                rows.append(head + ["n/a"] * 6)
                continue
            rel = r["policy_speedup"] / base["default_speedup"] if base else None
            width = "plain AR" if r.get("plain_ar") else str(r["policy_width"])
            rows.append(head + [num(r["default_round_ms"]), f"{num(r['default_speedup'], 2)}x", width,
                                num(r["policy_round_ms"]), f"{num(r['policy_speedup'], 2)}x", f"{num(rel, 2)}x"])
    return table(["call", "c", "setting", "tau", "default w=B-1 ms", "default speedup", "policy w", "policy ms",
                  "policy speedup", "policy over stock default"], rows)


def profile_table(shapes: list[dict]) -> str:
    """torch.profiler at c=1, w=7: wall without and with the profiler, GPU busy and idle, per variant."""
    rows = []
    for d in shapes:
        p = (d["steps"].get("profile") or {}).get("result")
        if not p:
            continue
        base = p["exllamav3"]
        for v in ("exllamav3", "recording", "policy"):
            x = p[v]
            rows.append([d["label"], str(x["rounds"]), v, num(x["wall_ms"]), num(x["profiled_wall_ms"]), num(x["gpu_busy_ms"]),
                         num(x["gpu_idle_ms"]), num(x["wall_ms"] - x["gpu_busy_ms"]),
                         "" if v == "exllamav3" else f"{x['gpu_idle_ms'] - base['gpu_idle_ms']:+.1f}",
                         "" if v == "exllamav3" else f"{x['wall_ms'] - base['wall_ms']:+.1f}"])
    return table(["call", "rounds", "variant", "wall ms", "wall under profiler ms", "GPU busy ms", "GPU idle ms (profiled)",
                  "wall - busy ms", "idle added", "wall added"], rows)


# -- real pair -------------------------------------------------------------------------------------------------


def widths(hist: dict) -> str:
    items = sorted(((int(w), n) for w, n in hist.items()), key=lambda x: x[0])
    return " ".join(f"{w}:{n}" for w, n in items)


def pair_table(pair: dict) -> str:
    """Measured tok/s per concurrency: AR, each block size, each lever, with the spread over repetitions."""
    rows = []
    for c in pair["concurrency"]:
        ar = next(a for a in pair["ar"] if a["concurrency"] == c)
        rows.append([str(c), "AR", "", cell(ar["spread"]["tok_s"]), "1.00x", cell(ar["spread"]["round_ms"]), "1", "-", ""])
        for x in (x for x in pair["cells"] if x["concurrency"] == c):
            rows.append([str(c), str(x["block_size"]), x.get("lever") or "", cell(x["spread"]["tok_s"]),
                         f"{num(x['speedup'], 2)}x", cell(x["spread"]["round_ms"]), num(x["tau"], 2), num(x["lossless"], 2),
                         widths(x.get("width_histogram") or {})])
    return table(["c", "B", "lever", "tok/s", "speedup", "round ms", "tau", "lossless", "widths verified (w:rounds)"], rows)


def pair_targets_table(pair: dict) -> str:
    from experiments.pair_mode import pair_targets

    rows = []
    for c, t in pair_targets(pair).items():
        p = t.get("paired")                     # paired per repetition: median (min-max) and the fixed block
        ratio = f"{cell(p, 3)} vs B={p['block_size']}" if p else num(t["auto_over_best_fixed"], 2)
        rows.append([c, f"{num(t['auto_speedup'], 2)}x", "yes" if t.get("at_least_2x_ar") else ("no" if c == "1" else "-"),
                     ratio, "yes" if t["within_3pct_of_best_fixed"] else "no",
                     "yes" if t["not_slower_than_ar"] else "no", num(t["lossless"], 2)])
    return table(["c", "auto speedup", ">= 2.0x (c=1)", "auto / best fixed", "within 3 %", "not > 5 % slower than AR",
                  "lossless"], rows)


# -- the numbers the prose quotes ------------------------------------------------------------------------------


def find(shapes: list[dict], call: str) -> dict | None:
    return next((d for d in shapes if d["label"] == call), None)


def prj(d: dict, setting: str, c: int, name: str = "DF-16") -> dict:
    return next(r for r in d["projection"]["rows"] if r["setting"] == setting and r["concurrency"] == c and r["name"] == name)


def derived(shapes: list[dict], pair: dict | None) -> list[tuple[str, str, str]]:
    """(quantity, value, where from) for the ratios the text quotes; skipped when a file is not given."""
    out = []
    c5, c6 = find(shapes, "call 5"), find(shapes, "call 6")      # the 2026-12-03 runs: a later file of that name
    if c5 and "chunked_verify" in c5["timing"]["round_ms"]:          # without their cells adds none of their rows
        r = c5["timing"]["round_ms"]
        stock15, chunk15 = r["stock"]["1"]["15"]["median"], r["chunked_verify"]["1"]["15"]["median"]
        out.append(("c=1, w=15: chunked_verify / stock (medians)", f"{chunk15:.1f} / {stock15:.1f} ms = {chunk15 / stock15:.2f}",
                    "call 5"))
        w17 = [r["stock"]["1"][str(w)]["median"] for w in (1, 3, 5, 7)]
        out.append(("c=1 stock, t_round w=1..7 (medians)", f"{min(w17):.1f}-{max(w17):.1f} ms", "call 5"))
        s, ch = prj(c5, "stock", 1), prj(c5, "chunked_verify", 1)
        out.append(("c=1 DF-16: stock default -> chunked_verify default", f"{s['default_speedup']:.2f}x -> {ch['default_speedup']:.2f}x",
                    "call 5 projection"))
        out.append(("c=1 DF-16: policy (chunked_verify) over stock default",
                    f"{ch['policy_speedup'] / s['default_speedup']:.2f}x", "call 5 projection"))
    if c6 and {"8", "16"} <= set(c6["timing"].get("ar_ms", {})):
        ar = c6["timing"]["ar_ms"]
        a8, a16 = ar["8"]["median"], ar["16"]["median"]
        out.append(("t_AR c=16 / c=8 (medians)", f"{a16:.1f} / {a8:.2f} ms = {a16 / a8:.1f}", "call 6"))
        out.append(("AR throughput c=8 vs c=16", f"{8000 / a8:.0f} vs {16000 / a16:.0f} tok/s", "call 6"))
        s16 = c6["timing"]["round_ms"]["stock"]["16"]["15"]["median"]
        out.append(("c=16 stock w=15 round / t_AR (raw medians)", f"{s16:.1f} / {a16:.1f} ms = {s16 / a16:.2f}", "call 6"))
        p16 = prj(c6, "stock", 16)
        tok = p16["policy_speedup"] * 16000 / p16["t_ar_ms"]
        out.append(("c=16 DF-16 stock policy, projected tok/s vs AR tok/s at c=8", f"{tok:.0f} vs {8000 / a8:.0f} = {tok / (8000 / a8):.2f}x",
                    "call 6 projection"))
    busy = [d["steps"]["profile"]["result"][v]["gpu_busy_ms"] for d in shapes if "profile" in d["steps"]
            for v in ("exllamav3", "recording", "policy")]
    if busy:
        out.append(("GPU busy per round, c=1 w=7, all variants and calls", f"{min(busy):.2f}-{max(busy):.2f} ms", "profiles"))
        prof = [d["steps"]["profile"]["result"][v] for d in shapes if "profile" in d["steps"] for v in ("exllamav3", "recording", "policy")]
        extra = [x["profiled_wall_ms"] - x["wall_ms"] for x in prof]
        out.append(("wall added per round by the profiler itself", f"{min(extra):.1f}-{max(extra):.1f} ms", "profiles"))
        kernels = {round(x["gpu_events"] / x["rounds"]) for x in prof}
        out.append(("GPU kernels per round, c=1 w=7", ", ".join(map(str, sorted(kernels))), "profiles"))
    if pair:
        spec = [x["speedup"] for x in pair["cells"] if x["concurrency"] > 1 and not x.get("lever")]
        lev = [x["speedup"] for x in pair["cells"] if x["concurrency"] > 1 and x.get("lever")]
        span = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"        # a run without lever cells: "-"
        ranges = f"{span(spec)} / {span(lev)}"
        out.append(("pair, c=4 and 8: speedup range without / with lever", ranges, "pair_bench"))
        b16 = next((x for x in pair["cells"] if x["concurrency"] == 1 and x["block_size"] == 16 and not x.get("lever")), None)
        acc = (b16 or {}).get("accept_per_position") or []          # a run without B=16 (--block-sizes auto 8): none
        if acc:
            out.append(("pair c=1 B=16 acceptance at positions 1-8", " ".join(f"{a:.2f}" for a in acc[:8]), "pair_bench"))
        ar1 = next((a for a in pair["ar"] if a["concurrency"] == 1), None)
        ar8 = next((a for a in pair["ar"] if a["concurrency"] == 8), None)
        if ar1 and ar8:
            out.append(("pair AR step c=1 vs c=8 (medians)", f"{ar1['round_ms']:.1f} vs {ar8['round_ms']:.1f} ms", "pair_bench"))
        lossless = [x["lossless"] for x in pair["cells"]]
        out.append(("pair, lossless over all cells (median, min)", f"{median(lossless):.2f}, {min(lossless):.2f}", "pair_bench"))
        same = [(a, b) for a in pair["cells"] for b in pair["cells"] if a["concurrency"] == b["concurrency"] == 8
                and a.get("lever") and b.get("lever") and a["block_size"] == 16 and b["block_size"] == "auto"
                and a.get("width_histogram") == b.get("width_histogram")]
        for a, b in same:
            out.append(("pair c=8, B=16 vs auto with dynamic_draft_tokens (same widths verified)",
                        f"{a['tok_s']:.1f} vs {b['tok_s']:.1f} tok/s", "pair_bench"))
    return out


def derived_table(shapes: list[dict], pair: dict | None) -> str:
    return table(["quantity", "value", "from"], [list(x) for x in derived(shapes, pair)])


# -- entry -----------------------------------------------------------------------------------------------------


def render(shapes: list[dict], pair: dict | None) -> dict[str, str]:
    """Table name -> Markdown table."""
    main = [d for d in shapes if d["label"] != "call 2"]
    first = [d for d in shapes if d["label"] == "call 2"]
    out = {"rounds": rounds_table(shapes), "ar_round": ar_round_table(shapes)}
    if main:
        out["projection"] = projection_table(main)
    if first:
        out["projection_call2"] = projection_table(first)
    out["profile"] = profile_table(shapes)
    if pair:
        out["pair"], out["pair_targets"] = pair_table(pair), pair_targets_table(pair)
    out["derived"] = derived_table(shapes, pair)
    return out


def report(folder: Path = DATED, shape: list[Path] | None = None, pair: Path | None = None, check: Path | None = None,
           only: list[str] | None = None) -> str:
    shapes = load_shapes(shape or [folder / n for n in SHAPES])
    tables = render(shapes, load_pair(pair or folder / PAIR))
    unknown = sorted(set(only or ()) - set(tables))
    if unknown:
        raise ToolkitError(f"--only: no table {unknown[0]!r} (have: {', '.join(tables)})")
    tables = {k: v for k, v in tables.items() if not only or k in only}
    if check is not None:
        doc = read_doc(check)
        missing = [k for k, v in tables.items() if v not in doc]
        if missing:
            raise ToolkitError(f"--check {check}: table(s) {', '.join(missing)} differ from the rendered ones "
                               f"(python -m experiments.speed_report --only {missing[0]})")
        return f"{check}: all {len(tables)} tables match"
    return "\n\n".join(f"<!-- {k} -->\n{v}" for k, v in tables.items())


def read_doc(path: Path) -> str:
    if not path.is_file():
        raise ToolkitError(f"--check {path}: no such file")
    return path.read_text()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.speed_report", description=__doc__.split("\n\n")[0],
                                 epilog="Example: python -m experiments.speed_report --only projection pair")
    ap.add_argument("--folder", type=Path, default=DATED, help=f"the dated raw-data folder (default {DATED})")
    ap.add_argument("--shape", type=Path, nargs="+", help=f"`speed shape` results (default: {', '.join(SHAPES)} in --folder)")
    ap.add_argument("--pair", type=Path, help=f"the pair's bench.json (default: {PAIR} in --folder)")
    ap.add_argument("--only", nargs="+", help="render only these tables (rounds, ar_round, projection, projection_call2, "
                    "profile, pair, pair_targets, derived)")
    ap.add_argument("--check", type=Path, help="instead of printing, check that this Markdown file holds the tables verbatim")
    a = ap.parse_args(argv)
    print(report(a.folder, a.shape, a.pair, a.check, a.only))


if __name__ == "__main__":
    run_cli(main)
