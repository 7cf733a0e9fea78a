"""Every iterate() of the exllamav3 backend's recording Generator, for `speed pair --trace`: which bench cell ran it,
when it started, the width asked, the decoding jobs, its wall ms and the tokens it emitted; under an auto
policy also what its choice saw (`rates`: the acceptance estimate a_1.., `curve`: ms per timed width). The pair bench's
medians say that `auto` trails the best fixed width by 3 %; the trace says where (rounds at exploratory widths,
dearer rounds at the same width, or time between rounds).

    python -m experiments.round_trace experiments/results/traces/pair_1206-0942_trace.jsonl.gz     (on the CPU)

prints, per bench cell, its rounds and tokens, the summed iterate() ms, the host time between iterates, tokens
per ms over both, its slow rounds (>= 1.4x the median of their shape, decoding jobs and width, over the whole
trace: how much of a card's slow stretches the cell met), and per width the rounds, median ms and tokens per round
of its one-job rounds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

SLOW = 1.4              # a round this many times its shape's median is a slow one


class RoundTrace:
    """Listens to toolkit.runtime.trace while installed (`install`, `remove`): `rows` holds one dict per iterate()
    of the recording Generator, labelled with the bench cell that ran it (a calibration's "calibrate/c<jobs>")."""

    def __init__(self):
        self.rows: list[dict] = []
        self.cell, self.outer = "", ""
        self.view: dict | None = None
        self.t0 = time.perf_counter()
        self._stop = None

    def install(self) -> RoundTrace:
        from toolkit.runtime import trace

        self._stop = trace.subscribe(self.event)
        return self

    def remove(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    def event(self, kind: str, f: dict) -> None:
        if kind == "cell":
            if f["label"].startswith("calibrate/"):
                self.outer = self.cell
            self.cell = f["label"]
        elif kind == "cell_end":
            self.cell = self.outer
        elif kind == "policy":
            self.view = f
        elif kind == "iterate":
            row = {"cell": self.cell, "t": round(f["t"] - self.t0, 6), "w": f["w"], "rows": f["rows"],
                   "jobs": f["jobs"], "ms": round(f["ms"], 3), "emitted": f["emitted"]}
            if self.view is not None:          # the auto policy's view before this round: rates and cost curve
                row.update(rates=self.view["rates"][:8], curve=self.view["curve"])
                self.view = None
            self.rows.append(row)

    def write(self, path: Path) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        return path


def summarize(rows: list[dict]) -> dict:
    """Per cell: rounds, tokens, the summed iterate() ms, the host ms between its consecutive iterates (median per
    round and sum), tokens per ms over both, its slow rounds, and per width (rounds, median ms, tokens per round)
    of its rounds with one decoding job (rows == 1, jobs == 1), where auto and the fixed widths compare directly."""
    shapes: dict = {}
    for r in rows:
        if r["rows"]:
            shapes.setdefault((r["rows"], r["w"]), []).append(r["ms"])
    median = {k: statistics.median(v) for k, v in shapes.items()}
    out: dict = {}
    for i, r in enumerate(rows):
        c = out.setdefault(r["cell"], {"rounds": 0, "tokens": 0, "iterate_ms": 0.0, "slow": 0, "gaps": [],
                                       "one_job": {}})
        c["rounds"] += 1
        c["slow"] += bool(r["rows"]) and r["ms"] >= SLOW * median[r["rows"], r["w"]]
        c["tokens"] += r["emitted"]
        c["iterate_ms"] += r["ms"]
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        if nxt is not None and nxt["cell"] == r["cell"]:
            c["gaps"].append((nxt["t"] - r["t"]) * 1000.0 - r["ms"])
        if r["rows"] == 1 and r["jobs"] == 1:
            c["one_job"].setdefault(r["w"], []).append((r["ms"], r["emitted"]))
    for c in out.values():
        gaps = c.pop("gaps")
        c["gap_ms"] = round(statistics.median(gaps), 3) if gaps else 0.0
        c["gaps_ms"] = round(sum(gaps), 1)
        c["iterate_ms"] = round(c["iterate_ms"], 1)
        busy = c["iterate_ms"] + c["gaps_ms"]
        c["tokens_per_ms"] = round(c["tokens"] / busy, 4) if busy > 0 else 0.0
        c["one_job"] = {w: {"rounds": len(v), "median_ms": round(statistics.median(m for m, _ in v), 3),
                            "tokens_per_round": round(sum(e for _, e in v) / len(v), 3)}
                        for w, v in sorted(c["one_job"].items())}
    return out


def read(path: Path) -> list[dict]:
    """The rows of a trace.jsonl, or of a gzipped one (.gz: how experiments/results/traces keeps them)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def table(cells: dict) -> str:
    """Markdown: one row per cell, then its one-job widths as "w: rounds x median ms, tokens/round"."""
    lines = ["| cell | rounds | tokens | iterate ms | gap ms (median) | gaps ms | tokens/ms | slow rounds "
             "| one-job rounds by width |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in cells.items():
        widths = "; ".join(f"w={w}: {x['rounds']} x {x['median_ms']:.2f} ms, {x['tokens_per_round']:.2f}"
                           for w, x in c["one_job"].items())
        lines.append(f"| {name} | {c['rounds']} | {c['tokens']} | {c['iterate_ms']:.0f} | {c['gap_ms']:.3f} | "
                     f"{c['gaps_ms']:.0f} | {c['tokens_per_ms']:.4f} | {c['slow']} | {widths} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.round_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a trace.jsonl written by `python -m experiments.speed pair --trace`")
    ap.add_argument("--cells", nargs="*", default=None, help="only cells whose name contains one of these (e.g. /n96)")
    a = ap.parse_args(argv)
    if not a.trace.is_file():
        print(f"error: {a.trace} is not a file", file=sys.stderr)
        return 2
    try:
        cells = summarize(read(a.trace))
    except (ValueError, KeyError, OSError, EOFError) as e:          # OSError, EOFError: a bad or cut .gz
        print(f"error: {a.trace} is not a round trace ({e})", file=sys.stderr)
        return 2
    if a.cells:
        cells = {k: v for k, v in cells.items() if any(s in k for s in a.cells)}
    print(table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
