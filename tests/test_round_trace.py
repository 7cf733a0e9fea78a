"""experiments/round_trace.py on the stand-in Generator: one row per iterate(), labelled by the bench's cell, whose
emitted tokens add up to what the jobs decoded; removing the trace puts exllamav3's seams back."""

from __future__ import annotations

import gzip
import json

import pytest
from exl3_fakes import Clock, FakeGenerator, make_backend

import toolkit.benchmark.grid as bg
import toolkit.exl3.backend as eb
from experiments.round_trace import RoundTrace, summarize
from toolkit.runtime.backend import GenSettings


def calibrations(trace: RoundTrace) -> int:
    return sum(r["cell"].startswith("calibrate/") for r in trace.rows)


def test_every_iterate_is_a_row_of_its_cell(monkeypatch, tmp_path):
    monkeypatch.setattr(FakeGenerator, "clock", Clock())
    before = (eb.recording_generator_class, bg.run_jobs, eb.calibrate)
    trace = RoundTrace().install()
    try:
        be = make_backend(monkeypatch, tmp_path)
        counts = {}
        for block, spec in ((8, True), ("auto", True), (8, False)):
            start, calib = sum(g.iterations for g in FakeGenerator.built), calibrations(trace)
            rounds, _ = bg.run_jobs(be, [[11, 12], [13, 14]], GenSettings(max_new_tokens=40, block_size=block, stop_ids=()), spec)
            label = f"{block if spec else 'ar'}/c2/n40"
            iterates = sum(g.iterations for g in FakeGenerator.built) - start - (calibrations(trace) - calib)
            counts[label] = (iterates, sum(len(r.tokens) for job in rounds for r in job))
    finally:
        trace.remove()
    assert (eb.recording_generator_class, bg.run_jobs, eb.calibrate) == before
    assert any(r["cell"] == "calibrate/c2" for r in trace.rows)          # auto timed c=2 first: apart from its cell
    cells = summarize(trace.rows)
    for label, (iterates, tokens) in counts.items():
        mine = [r for r in trace.rows if r["cell"] == label]
        assert len(mine) == iterates and cells[label]["rounds"] == iterates
        assert sum(r["emitted"] for r in mine) == tokens == 80
    fixed = [r for r in trace.rows if r["cell"] == "8/c2/n40" and r["rows"]]
    assert {r["w"] for r in fixed} == {7} and all(r["jobs"] in (1, 2) and r["ms"] >= 0 for r in fixed)
    assert {r["w"] for r in trace.rows if r["cell"] == "ar/c2/n40"} == {0}
    assert [r["t"] for r in trace.rows] == sorted(r["t"] for r in trace.rows)
    path = trace.write(tmp_path / "trace.jsonl")
    assert len(path.read_text().splitlines()) == len(trace.rows)


def test_the_cli_renders_a_trace_and_refuses_other_files(tmp_path, capsys):
    from experiments.round_trace import main

    rows = [{"cell": "8/c1/n96", "t": 0.0, "w": 7, "rows": 1, "jobs": 1, "ms": 10.0, "emitted": 3},
            {"cell": "8/c1/n96", "t": 0.0105, "w": 7, "rows": 1, "jobs": 1, "ms": 12.0, "emitted": 1},
            {"cell": "auto/c1/n96", "t": 0.03, "w": 3, "rows": 1, "jobs": 1, "ms": 8.0, "emitted": 2}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = summarize(rows)
    assert cells["8/c1/n96"]["gap_ms"] == pytest.approx(0.5) and cells["8/c1/n96"]["tokens_per_ms"] == pytest.approx(4 / 22.5, abs=1e-4)
    assert cells["8/c1/n96"]["one_job"] == {7: {"rounds": 2, "median_ms": 11.0, "tokens_per_round": 2.0}}
    assert main([str(trace), "--cells", "auto"]) == 0
    out = capsys.readouterr().out
    assert "| auto/c1/n96 | 1 | 2 | 8 |" in out and "8/c1/n96" not in out
    packed = tmp_path / "trace.jsonl.gz"                       # how docs/speed_* keep traces
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    assert main([str(packed), "--cells", "auto"]) == 0 and capsys.readouterr().out == out
    (tmp_path / "bad.jsonl").write_text("not json\n")
    (tmp_path / "bad.jsonl.gz").write_text("not gzip\n")
    assert main([str(tmp_path / "bad.jsonl")]) == 2 and main([str(tmp_path / "none.jsonl")]) == 2
    assert main([str(tmp_path / "bad.jsonl.gz")]) == 2
    assert capsys.readouterr().err.count("error: ") == 3
