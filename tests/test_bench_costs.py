"""bench.json's "costs" of `auto` cells: the cost curve the policy started from and the one it learned, per
concurrency and width, on the torch backend (tiny pair, CPU) and on the exllamav3 stand-in."""

from __future__ import annotations

import json
import re

import pytest

from toolkit.bench import BenchOptions, bench, main
from toolkit.costs.table import CostTable


def curves_ok(costs: dict, concurrencies: set[str], widths: int) -> None:
    """Both curves cover these concurrencies, each width 0..widths-1 once, in ms > 0, never falling with w."""
    assert set(costs["start"]) == set(costs["learned"]) == concurrencies
    for part in ("start", "learned"):
        for curve in costs[part].values():
            assert list(curve) == [str(w) for w in range(widths)]
            ms = list(curve.values())
            assert all(t > 0 for t in ms) and all(a <= b for a, b in zip(ms[1:], ms[2:]))


def test_auto_cells_record_their_cost_curves_on_the_torch_backend(tmp_path, monkeypatch, steady_costs):
    monkeypatch.setenv("DFLASH_COST_CACHE", str(tmp_path / "costs"))
    r = bench(BenchOptions(backend="torch", block_sizes=["auto", 4], concurrency=[1], max_new_tokens=8, limit=2,
              out=str(tmp_path / "o"), warmup=False, quiet=True))
    saved = json.loads((tmp_path / "o" / "bench.json").read_text())
    auto, fixed = saved["cells"]
    assert auto["block_size"] == "auto" and "costs" not in fixed
    curves_ok(auto["costs"], {"1"}, r["native_block_size"])
    table = json.loads(next((tmp_path / "costs").glob("*.json")).read_text())["ms"]["1"]
    curve = CostTable({1: table}).curve(r["native_block_size"])                           # the measured table's curve
    assert [auto["costs"]["start"]["1"][str(w)] for w in range(len(curve))] == pytest.approx(curve, abs=1e-3)
    # a table timed on a loaded machine may be scaled to the live AR rounds; its source then says so
    assert re.fullmatch(r"(cached .+|timed now)(; its AR step took [\d.]+ ms, the live AR rounds [\d.]+ ms: scaled to "
                        r"them)?", auto["costs"]["source"]), auto["costs"]["source"]
    seen = auto["costs"]["observed"]["1"]
    learned = {int(w): t for w, t in auto["costs"]["learned"]["1"].items()}
    for w, o in seen.items():                   # a width seen often enough costs what its rounds took
        if o["rounds"] >= 3:
            assert learned[int(w)] == pytest.approx(o["ms"], abs=1e-2) or int(w) > 0 and learned[int(w)] >= learned[0]


def test_auto_cells_record_observed_rounds_per_concurrency_on_exllamav3(monkeypatch, tmp_path):
    from exl3_fakes import make_backend

    import toolkit.bench as bench_mod

    monkeypatch.setattr(bench_mod, "load_backend", lambda *a, **k: make_backend(monkeypatch, tmp_path))
    main(["--backend", "exllamav3", "--block-sizes", "auto", "4", "--concurrency", "1", "2", "--max-new-tokens", "24",
          "--limit", "2", "--no-warmup", "--quiet", "--out", str(tmp_path / "o")])
    cells = json.loads((tmp_path / "o" / "bench.json").read_text())["cells"]
    for c in cells:
        if c["block_size"] != "auto":
            assert "costs" not in c
            continue
        costs = c["costs"]
        seen = set(costs["observed"])
        assert seen and seen <= {"1", "2"}
        curves_ok(costs, {"1", "2"} if c["concurrency"] == 2 else {"1"} | seen, 8)
        for conc, obs in costs["observed"].items():
            assert all(set(o) == {"ms", "rounds"} and o["rounds"] >= 1 for o in obs.values())
            assert all(o["ms"] > 0 if o["rounds"] else o["ms"] is None for o in obs.values())   # warm-up rounds only: no cost


def test_calibration_records_the_tokens_a_job_emits_per_round(monkeypatch, tmp_path):
    """A drafter right on every id makes a width-w calibration round emit w + 1 tokens a job; one always wrong, 1."""
    from exl3_fakes import FakeGenerator, make_backend

    from toolkit.exl3.calibrate import calibrate

    for good, expect in ((lambda last, block: block, lambda w: w + 1), (lambda last, block: 0, lambda w: 1)):
        monkeypatch.setattr(FakeGenerator, "good", staticmethod(good))
        be = make_backend(monkeypatch, tmp_path)
        emitted: dict = {}
        ms = calibrate(be, 2, emitted=emitted)
        assert set(emitted) == set(ms) and emitted == {w: expect(w) for w in ms}


def test_bench_reports_the_calibration_tokens_on_exllamav3(monkeypatch, tmp_path):
    from exl3_fakes import make_backend

    import toolkit.bench as bench_mod

    monkeypatch.setenv("DFLASH_COST_CACHE", str(tmp_path / "costs"))
    monkeypatch.setattr(bench_mod, "load_backend", lambda *a, **k: make_backend(monkeypatch, tmp_path))
    main(["--backend", "exllamav3", "--block-sizes", "auto", "--concurrency", "1", "--max-new-tokens", "16",
          "--limit", "2", "--no-warmup", "--quiet", "--out", str(tmp_path / "o")])
    auto = next(c for c in json.loads((tmp_path / "o" / "bench.json").read_text())["cells"] if c["block_size"] == "auto")
    tokens = auto["costs"]["calibration_tokens"]["1"]
    assert tokens and all(1 <= t <= int(w) + 1 for w, t in tokens.items())
