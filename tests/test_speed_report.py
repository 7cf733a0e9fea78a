"""experiments.speed_report on the committed H200 data of 2026-12-03 (docs/speed_2026-12-03/): the tables hold the
files' numbers, the draft_max_rows projection is refused, the pair's targets are evaluated, and docs/performance.md
and docs/benchmarks.md still hold the rendered tables verbatim."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.speed_report import DATED, SHAPES, cell, load_shapes, render, report
from toolkit.core.errors import ToolkitError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / DATED


@pytest.fixture(scope="module")
def tables() -> dict[str, str]:
    shapes = load_shapes([DATA / n for n in SHAPES])
    return render(shapes, json.loads((DATA / "pair_bench.json").read_text()))


def test_cell_formats_median_and_range():
    assert cell({"n": 4, "median": 7.11, "min": 6.67, "max": 7.64}) == "7.1 (6.7-7.6)"
    assert cell({"n": 1, "median": 9.02, "min": 9.02, "max": 9.02}) == "9.0"
    assert cell({"n": 0, "median": None}) == "-" and cell(None) == "-"


def test_round_costs_come_from_the_files(tables):
    rounds = tables["rounds"]
    assert "| call 5 | 1 | stock | 4 | 7.1 (6.7-7.6) | 9.5 (9.1-9.7) |" in rounds
    assert "| call 5 | 1 | chunked_verify | 4 |  |" in rounds and "| 30.0 (28.0-31.1) |" in rounds
    assert "| call 6 | 16 | stock | 3 | 60.4 (56.2-70.4) |" in rounds
    assert "| call 2 | 1 | stock | 1 | 9.0 | 9.7 | 28.7 |" in rounds
    assert "| call 5 | 1 | 4 | 7.11 | 9.50 | 1.34 |" in tables["ar_round"]


def test_projection_keeps_the_files_numbers_and_refuses_the_row_ceiling(tables):
    prj = tables["projection"]
    assert "| call 5 | 1 | stock | DF-16 (7.63) | 56.5 | 0.96x | 7 | 21.3 | 1.83x | 1.91x |" in prj
    assert "| call 5 | 1 | chunked_verify | DF-16 (7.63) | 30.0 | 1.81x | 7 | 19.7 | 1.98x | 2.06x |" in prj
    # draft_max_rows trims the window itself: the width asked for is not the width verified
    assert "| call 6 | 8 | draft_max_rows=8 | DF-16 (7.63) | n/a |" in prj
    assert "6.38x" not in prj and "call 2" not in prj
    assert "| call 2 | 1 | draft_max_rows | DF-16 (7.63) | n/a |" in tables["projection_call2"]


def test_profile_and_pair_tables(tables):
    assert "| call 2 | 24 | policy | 28.6 | 34.2 | 13.0 | 21.1 | 15.5 | +10.0 | +9.6 |" in tables["profile"]
    pair = tables["pair"]
    assert "| 1 | AR |  | 47.4 (38.5-52.0) | 1.00x |" in pair
    assert "| 1 | auto |  | 55.1 (50.4-79.0) | 1.16x |" in pair and "0:137 8:351 15:19" in pair
    assert "| 8 | 8 | dynamic_draft_tokens | 262.5 (194.2-293.9) | 1.09x |" in pair
    targets = tables["pair_targets"]
    assert "| 1 | 1.16x | no | 0.82 | no | yes | 1.00 |" in targets
    assert "| 4 | 0.89x | - | 0.95 | no | no | 1.00 |" in targets
    derived = tables["derived"]
    assert "30.0 / 56.5 ms = 0.53" in derived and "586 vs 265 tok/s" in derived and "| 944 |" in derived


def test_pair_targets_read_the_paired_ratio_where_the_file_has_one():
    from experiments.speed_report import pair_targets_table

    old = json.loads((DATA / "pair_bench.json").read_text())              # no per-repetition numbers: as before
    assert "| 1 | 1.16x | no | 0.82 | no | yes | 1.00 |" in pair_targets_table(old)
    new = json.loads(json.dumps(old))
    auto1 = next(x for x in new["cells"] if x["concurrency"] == 1 and x["block_size"] == "auto" and not x.get("lever"))
    auto1["auto_over_best_fixed"] = {"block_size": 8, "ratios": [0.96, 0.99, 1.01], "n": 3, "median": 0.99,
                                     "min": 0.96, "max": 1.01, "q1": 0.975, "q3": 1.0}
    assert "| 1 | 1.16x | no | 0.990 (0.960-1.010) vs B=8 | yes | yes | 1.00 |" in pair_targets_table(new)
    assert "| 4 | 0.89x | - | 0.95 | no | no | 1.00 |" in pair_targets_table(new)   # cells without: the medians


def test_the_docs_hold_the_rendered_tables():
    assert "all 8 tables match" in report(DATA, check=ROOT / "docs" / "performance.md")
    assert "all 2 tables match" in report(DATA, check=ROOT / "docs" / "benchmarks.md", only=["pair", "pair_targets"])


def test_check_reports_a_drifted_table(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("no tables here\n")
    with pytest.raises(ToolkitError, match="table\\(s\\) pair differ"):
        report(DATA, check=doc, only=["pair"])
    with pytest.raises(ToolkitError, match="--only: no table 'nope'"):
        report(DATA, only=["nope"])


def test_bad_input_is_one_error_line(tmp_path):
    wrong = tmp_path / "x.json"
    wrong.write_text(json.dumps({"mode": "pair"}))
    with pytest.raises(ToolkitError, match="not a `speed shape` result"):
        load_shapes([wrong])
    run = subprocess.run([sys.executable, "-m", "experiments.speed_report", "--shape", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith("error: --shape ")
    assert "Traceback" not in run.stderr


def test_a_pair_run_without_b16_or_c8_still_renders():
    """`speed pair --block-sizes auto 8 --concurrency 1 4` (session 20 ran auto and 8 only): the derived table skips
    the ratios it has no cell for instead of failing."""
    pair = json.loads((DATA / "pair_bench.json").read_text())
    pair["cells"] = [x for x in pair["cells"] if x["block_size"] != 16 and x["concurrency"] < 8]
    pair["ar"] = [a for a in pair["ar"] if a["concurrency"] < 8]
    pair["concurrency"] = [c for c in pair["concurrency"] if c < 8]
    out = render(load_shapes([DATA / n for n in SHAPES]), pair)
    assert "B=16 acceptance" not in out["derived"] and "AR step c=1 vs c=8" not in out["derived"]
    assert "| 1 | auto |" in out["pair"] and "| 16 |" not in out["pair"]


def test_a_later_file_labelled_like_the_first_runs_renders_without_their_rows():
    """Session 21's shape_call5.json is "call 5" too, without the 2026-12-03 call 5's chunked_verify cells: the
    derived rows that quote those cells are skipped, the rounds and projection come from the file."""
    out = report(shape=[ROOT / "docs" / "speed_2026-12-06-s21" / "shape_call5.json"], only=["rounds", "projection"])
    assert "| call 5 | 1 | graph_draft_swa | DF-16 (7.63) | 31.2 | 1.52x | 7 | 15.3 | 2.24x | 1.53x |" in out
