"""Every iterate() of the exllamav3 backend's recording Generator, for `speed pair --trace`: which bench cell ran it,
when it started, the width asked, the decoding jobs, its wall ms and the tokens it emitted. The pair bench's
medians say that `auto` trails the best fixed width by 3 %; the trace says where (rounds at exploratory widths,
dearer rounds at the same width, or time between rounds)."""

from __future__ import annotations

import json
import time
from pathlib import Path


class RoundTrace:
    """Installs itself over exl3_backend.recording_generator_class, exl3_backend.calibrate and benchgrid.run_jobs
    (`install`), and puts them back (`remove`); `rows` holds one dict per iterate(), a calibration's in its own
    cell ("calibrate/c<jobs>")."""

    def __init__(self):
        self.rows: list[dict] = []
        self.cell: str = ""
        self.t0 = time.perf_counter()
        self._undo: list = []

    def install(self) -> RoundTrace:
        import toolkit.runtime.benchgrid as bg
        import toolkit.runtime.exl3_backend as eb

        trace, make, run_jobs, calibrate = self, eb.recording_generator_class, bg.run_jobs, eb.calibrate

        def traced_class(generator_cls: type) -> type:
            class Traced(make(generator_cls)):
                def iterate(self):
                    return trace.time(self, super().iterate)

            return Traced

        def labelled(backend, prompts, settings, speculative):
            trace.cell = f"{settings.block_size if speculative else 'ar'}/c{len(prompts)}/n{settings.max_new_tokens}"
            return run_jobs(backend, prompts, settings, speculative)

        def calibrating(backend, concurrency, *a, **k):
            cell, trace.cell = trace.cell, f"calibrate/c{concurrency}"
            try:
                return calibrate(backend, concurrency, *a, **k)
            finally:
                trace.cell = cell

        eb.recording_generator_class, bg.run_jobs, eb.calibrate = traced_class, labelled, calibrating
        self._undo = [(eb, "recording_generator_class", make), (bg, "run_jobs", run_jobs), (eb, "calibrate", calibrate)]
        return self

    def remove(self) -> None:
        for module, name, value in self._undo:
            setattr(module, name, value)
        self._undo = []

    def time(self, gen, iterate):
        jobs = list(gen.active_jobs)
        before = [len(j.sequences[0].sequence_ids) for j in jobs]
        rows = sum(1 for j in jobs if j.is_prefill_done())
        width = gen.num_draft_tokens if gen.draft_model is not None else 0
        t0 = time.perf_counter()
        out = iterate()
        ms = (time.perf_counter() - t0) * 1000.0
        emitted = sum(len(j.sequences[0].sequence_ids) - b for j, b in zip(jobs, before))
        self.rows.append({"cell": self.cell, "t": round(t0 - self.t0, 4), "w": width, "rows": rows,
                          "jobs": len(jobs), "ms": round(ms, 3), "emitted": emitted})
        return out

    def write(self, path: Path) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        return path


def summarize(rows: list[dict]) -> dict:
    """Per cell: rounds, tokens, the summed iterate ms and per width (rounds, median ms, tokens per round) of
    decoding rounds at one job (rows == 1, jobs == 1), the rounds where auto and the fixed widths compare directly."""
    import statistics

    out: dict = {}
    for r in rows:
        c = out.setdefault(r["cell"], {"rounds": 0, "tokens": 0, "iterate_ms": 0.0, "one_job": {}})
        c["rounds"] += 1
        c["tokens"] += r["emitted"]
        c["iterate_ms"] += r["ms"]
        if r["rows"] == 1 and r["jobs"] == 1:
            c["one_job"].setdefault(r["w"], []).append((r["ms"], r["emitted"]))
    for c in out.values():
        c["iterate_ms"] = round(c["iterate_ms"], 1)
        c["one_job"] = {w: {"rounds": len(v), "median_ms": round(statistics.median(m for m, _ in v), 3),
                            "tokens_per_round": round(sum(e for _, e in v) / len(v), 3)}
                        for w, v in sorted(c["one_job"].items())}
    return out
