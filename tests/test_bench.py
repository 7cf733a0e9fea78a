"""The benchmark CLI and function on the torch backend with the tiny trained pair (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.assets.prompts import BUILTIN, load_prompts
from toolkit.bench import BenchOptions, bench, job_list, main, run_jobs
from toolkit.core.errors import ToolkitError
from toolkit.runtime.backend import Backend, GenSettings
from toolkit.runtime.events import Round, tokens_of


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    r = bench(BenchOptions(backend="torch", block_sizes=[4, 64], concurrency=[1, 2], max_new_tokens=10, limit=3,
              out=str(out), warmup=False, quiet=True))
    return r, out


def test_bench_grid_json_and_plot(result):
    r, out = result
    assert json.loads((out / "bench.json").read_text()) == json.loads(json.dumps(r))
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["out"]             # no temp folder left behind
    assert r["block_sizes"] == [4, 16]                                   # 64 is cut to the drafter's 16
    assert [(c["block_size"], c["concurrency"]) for c in r["cells"]] == [(b, c) for b in (4, 16) for c in (1, 2)]
    assert r["categories"] == ["chat", "code", "math"] and r["num_prompts"] == 3
    ar = {a["concurrency"]: a for a in r["ar"]}
    for c in r["cells"]:
        assert c["lossless"] == 1.0                                      # greedy: the target's own tokens
        assert len(c["accept_per_position"]) == c["block_size"] - 1
        assert c["speedup"] == pytest.approx(c["tok_s"] / ar[c["concurrency"]]["tok_s"])
        assert c["tau"] >= 1.0 and c["tokens"] == ar[c["concurrency"]]["tokens"] and c["jobs"] == {1: 3, 2: 4}[c["concurrency"]]


def test_best_per_concurrency_picks_the_fastest_or_ar(result):
    from toolkit.bench import best_per_concurrency

    r, _ = result
    assert [b["concurrency"] for b in r["best"]] == [1, 2]
    for b in r["best"]:
        spec = [c for c in r["cells"] if c["concurrency"] == b["concurrency"]]
        top = max(spec, key=lambda c: c["tok_s"])
        if b["block_size"] is None:
            assert top["speedup"] <= 1.0 and b["speedup"] == 1.0
        else:
            assert b["block_size"] == top["block_size"] and b["speedup"] == top["speedup"] > 1.0
    ar = [{"concurrency": 1, "tok_s": 50.0}, {"concurrency": 8, "tok_s": 500.0}]
    cells = [{"concurrency": 1, "block_size": 8, "tok_s": 100.0, "speedup": 2.0},
             {"concurrency": 1, "block_size": 16, "tok_s": 80.0, "speedup": 1.6},
             {"concurrency": 8, "block_size": 8, "tok_s": 400.0, "speedup": 0.8}]
    assert best_per_concurrency(ar, cells) == [{"concurrency": 1, "block_size": 8, "speedup": 2.0},
                                               {"concurrency": 8, "block_size": None, "speedup": 1.0}]


def test_cli_prints_the_table(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Return the number of items", "category": "doc"}\n\nSplit the string at sep\n')
    main(["--prompts", str(prompts), "--block-sizes", "8", "--concurrency", "1", "--max-new-tokens", "8",
          "--out", str(tmp_path / "o"), "--raw", "--no-warmup"])
    out = capsys.readouterr().out
    assert "speedup" in out and "  8     1" in out and "fastest measured per concurrency: c=1: " in out
    r = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert r["categories"] == ["doc", "file"] and r["raw"] is True


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "toolkit.bench", "--concurrency", "0", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --concurrency must be integers >= 1, got [0]"
    assert not (tmp_path / "x").exists()


def test_prompt_files(tmp_path):
    assert len(BUILTIN) >= 20 and {p.category for p in BUILTIN} == {"chat", "code", "math"}
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(ToolkitError, match=r"line 2 has no \"prompt\" string"):
        load_prompts(f)
    f.write_text("\n\n")
    with pytest.raises(ToolkitError, match="has no prompts"):
        load_prompts(f)
    with pytest.raises(ToolkitError, match="is not a file"):
        load_prompts(tmp_path / "missing")


def test_job_list_fills_whole_waves():
    ids = [[1], [2], [3]]
    assert job_list(ids, 1) == ids
    assert job_list(ids, 2) == [[1], [2], [3], [1]]
    assert len(job_list(ids, 32)) == 32


class Sequential(Backend):
    """A backend that does not batch: the base class runs its jobs one after another."""

    name, block_size, max_context, eos_ids, tokenizer = "fake", 4, 100, (), None

    def generate(self, ids, settings, speculative=True):
        yield Round((), 0, ids[0], prefill=True)
        yield Round((9, 9, 9) if speculative else (), 0, ids[0] + 1)


class Batched(Sequential):
    def generate_many(self, prompts, settings, speculative=True):
        for i in reversed(range(len(prompts))):            # rounds of jobs arrive interleaved
            for r in self.generate(prompts[i], settings, speculative):
                yield i, r


@pytest.mark.parametrize("backend", [Sequential(), Batched()])
def test_run_jobs_with_and_without_generate_many(backend):
    rounds, secs = run_jobs(backend, [[1], [5]], GenSettings(), True)
    assert [tokens_of(r) for r in rounds] == [[1, 2], [5, 6]] and secs >= 0


def test_factory_errors(tmp_path):
    from toolkit.runtime.factory import load_backend

    with pytest.raises(ToolkitError, match="backend must be one of torch, exllamav3, got 'vllm'"):
        load_backend("vllm", tmp_path)
    with pytest.raises(ToolkitError, match="draft: .*missing is not a folder"):
        load_backend("torch", tmp_path, tmp_path / "missing")


# -- repetitions, levers, auto and the projection (issue 16) ------------------------------------------------


def test_projection_from_a_scripted_cost_table():
    from toolkit.costs.table import CostTable
    from toolkit.benchmark.projection import alpha_for, expected_tokens, project

    table = CostTable({1: {0: 10.0, 1: 12.0, 2: 14.0, 3: 30.0}})
    tau = 1 + 0.9 + 0.81 + 0.729                                  # alpha 0.9 at B = 4
    r = project(table, 1, tau, 4)
    assert r["alpha"] == pytest.approx(0.9, abs=1e-6) and r["default_width"] == 3 and r["policy_width"] == 2
    assert r["default_speedup"] == pytest.approx(3.439 / 30 * 10)             # defaults: all B-1 drafts every round
    assert r["policy_speedup"] == pytest.approx(2.71 / 14 * 10)               # (1 + .9 + .81) tokens per 14 ms
    assert r["policy_over_default"] == pytest.approx((2.71 / 14) / (3.439 / 30))
    assert project(table, 1, tau, 4, t_ar=8.0)["policy_speedup"] == pytest.approx(2.71 / 14 * 8)
    slow = project(CostTable({1: {0: 10.0, 1: 40.0, 3: 60.0}}), 1, 1.5, 4)
    assert slow["policy_width"] == 0 and slow["policy_speedup"] == 1.0        # no width wins: AR
    dear = project(CostTable({1: {0: 12.0, 1: 24.0, 3: 40.0}}), 1, 1.5, 4, t_ar=10.0)   # spec AR rounds cost 12
    assert dear["plain_ar"] and dear["policy_width"] == 0 and dear["policy_round_ms"] == 10.0
    assert dear["policy_speedup"] == 1.0 and dear["policy_over_default"] == pytest.approx((1 / 10) / (1.5 / 40))
    assert not project(table, 1, tau, 4)["plain_ar"]
    for tau, B in ((7.63, 16), (5.74, 8)):
        assert expected_tokens(alpha_for(tau, B), B)[-1] == pytest.approx(tau)
    assert alpha_for(1.0, 16) == 0.0 and alpha_for(16, 16) == 1.0


def test_parse_taus_and_spread():
    from toolkit.benchmark.projection import parse_taus, spread

    assert parse_taus(["published", "3@8"]) == [("DF-16", 7.63, 16), ("DF-8", 5.74, 8), ("tau 3@8", 3.0, 8)]
    for bad in ("7.63", "9@8", "x@16"):
        with pytest.raises(ToolkitError, match="--project-tau"):
            parse_taus([bad])
    s = spread([3.0, 1.0, 2.0, 4.0])
    assert (s["n"], s["median"], s["min"], s["max"], s["q1"], s["q3"]) == (4, 2.5, 1.0, 4.0, 1.75, 3.25)
    assert spread([5.0])["q1"] == spread([5.0])["q3"] == 5.0


def test_project_cells_per_setting_group():
    from toolkit.benchmark.grid import project_cells

    ar = [{"concurrency": 1, "round_ms": 10.0}]
    cells = [{"concurrency": 1, "block_size": 2, "round_ms": 12.0}, {"concurrency": 1, "block_size": 4, "round_ms": 30.0},
             {"concurrency": 1, "block_size": "auto", "round_ms": 11.0},
             {"concurrency": 1, "block_size": 4, "round_ms": 20.0, "lever": "chunked_verify"}]
    rows = project_cells(ar, cells, [("x", 3.439, 4), ("wide", 9.0, 16)])       # B=16 was not measured: left out
    assert [(r["setting"], r["name"]) for r in rows] == [("stock", "x"), ("chunked_verify", "x")]
    stock, lever = rows
    assert stock["policy_width"] == 1 and stock["policy_speedup"] == pytest.approx(1.9 / 12 * 10)   # w=2 at 21 ms (interpolated) loses
    assert stock["default_speedup"] == pytest.approx(3.439 / 30 * 10)
    assert lever["policy_width"] == 3 and lever["policy_over_default"] == pytest.approx(1.0)


def test_reps_interleave_every_cell_rep_by_rep(monkeypatch):
    from toolkit.benchmark import grid as benchgrid
    from toolkit.benchmark.grid import Cell, run_grid

    calls, secs = [], iter([1.0, 2.0, 4.0, 1.0, 1.0, 8.0])       # AR then B=4, B=4 then AR, AR then B=4

    def fake_cell(be, ids, conc, settings, speculative, warmup):
        calls.append((settings.block_size if speculative else None, conc))
        drafted = (ids[0][0] + 1,) if speculative else ()
        return [[Round((), 0, ids[0][0], prefill=True), Round(drafted, len(drafted), ids[0][0] + 1 + len(drafted))]], next(secs)

    monkeypatch.setattr(benchgrid, "run_cell", fake_cell)
    cells = [Cell(None, 1), Cell(4, 1)]
    ar, spec = run_grid(Sequential(), [[1]], GenSettings(max_new_tokens=4), cells, reps=3, warmup=False)
    assert calls == [(None, 1), (4, 1), (4, 1), (None, 1), (None, 1), (4, 1)]    # rep by rep, the order rotating
    (a,), (s,) = ar, spec
    assert a["reps"] == s["reps"] == 3 and a["spread"]["tok_s"]["n"] == 3
    assert a["tok_s"] == 2.0 and s["tok_s"] == 3.0 / 4.0                        # medians of 2/1, 2/1, 2/1 and 3/2, 3/4, 3/8
    assert s["spread"]["tok_s"]["min"] == 3 / 8 and s["spread"]["tok_s"]["max"] == 3 / 2
    assert s["lossless"] == 0.0 and s["width_histogram"] == {1: 3} and "t_ar_ms" in s["spread"]


def test_cells_of_a_concurrency_interleave_wave_by_wave(monkeypatch):
    from toolkit.benchmark import grid as benchgrid
    from toolkit.benchmark.grid import Cell, run_grid

    calls = []

    def fake_cell(be, ids, conc, settings, speculative, warmup):
        calls.append((settings.block_size if speculative else "ar", ids[0][0], warmup))
        return [[Round((), 0, 5, prefill=True), Round((), 0, 6)] for _ in ids], 1.0

    monkeypatch.setattr(benchgrid, "run_cell", fake_cell)
    cells = [Cell(None, 1), Cell(4, 1), Cell(None, 2), Cell(4, 2)]
    ar, spec = run_grid(Sequential(), [[1], [2]], GenSettings(max_new_tokens=4), cells, reps=2, warmup=True)
    assert calls[:6] == [("ar", 1, True), (4, 1, True), (4, 2, False), ("ar", 2, False),    # c=1: wave by wave
                         ("ar", 1, True), (4, 1, True)]                                    # c=2: one wave of both
    assert calls[6:8] == [(4, 1, True), ("ar", 1, True)]                                   # the next rep starts turned
    assert [c["reps"] for c in ar + spec] == [2, 2, 2, 2]
    assert all(c["tokens"] == 4 for c in ar + spec)                                        # both waves of every cell


def test_auto_is_paired_rep_by_rep_with_the_best_fixed_block(monkeypatch):
    from toolkit.benchmark import grid as benchgrid
    from toolkit.benchmark.grid import Cell, run_grid

    secs = iter([1.0, 1.0, 1.5, 1.2,  2.0, 1.0, 1.5, 1.0,  1.25, 1.0, 1.0, 1.2])    # AR, auto, B=4, B=8 rotating

    def fake_cell(be, ids, conc, settings, speculative, warmup):
        drafted = (ids[0][0] + 1,) if speculative else ()
        return [[Round((), 0, ids[0][0], prefill=True), Round(drafted, len(drafted), ids[0][0] + 1 + len(drafted))]], next(secs)

    monkeypatch.setattr(benchgrid, "run_cell", fake_cell)
    cells = [Cell(None, 1), Cell("auto", 1), Cell(4, 1), Cell(8, 1)]
    _, (auto, b4, b8) = run_grid(Sequential(), [[1]], GenSettings(max_new_tokens=4), cells, reps=3, warmup=False)
    assert auto["tok_s_reps"] == [3.0, 1.5, 2.5] and b4["tok_s_reps"] == [2.0, 3.0, 2.4] and b8["tok_s_reps"] == [2.5, 2.0, 3.0]
    paired = auto["auto_over_best_fixed"]                              # B=8 is best by median (2.5 against 2.4)
    assert paired["block_size"] == 8 and paired["ratios"] == pytest.approx([1.2, 0.75, 2.5 / 3])
    assert paired["median"] == pytest.approx(2.5 / 3) and paired["min"] == 0.75 and paired["n"] == 3
    assert auto["tok_s"] / b8["tok_s"] == 1.0                          # the ratio of medians hides the pairing
    assert "auto_over_best_fixed" not in b4 and "auto_over_best_fixed" not in b8


def test_bench_auto_levers_reps_and_projection_on_exllamav3(monkeypatch, tmp_path, capsys):
    from exl3_fakes import make_backend

    import toolkit.bench as bench_mod

    monkeypatch.setattr(bench_mod, "load_backend", lambda *a, **k: make_backend(monkeypatch, tmp_path))
    main(["--backend", "exllamav3", "--block-sizes", "auto", "4", "8", "--concurrency", "1", "2", "--reps", "2",
          "--levers", "graph_draft_swa=off", "--project-tau", "published", "3@8", "--max-new-tokens", "12",
          "--limit", "2", "--no-warmup", "--out", str(tmp_path / "o")])
    r = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert r["block_sizes"] == ["auto", 4, 8] and r["reps"] == 2 and r["levers"] == ["graph_draft_swa=off"]
    settings = [(c["block_size"], c["concurrency"], c.get("lever")) for c in r["cells"]]
    assert settings == [(B, c, lv) for lv in (None, "graph_draft_swa=off") for B in ("auto", 4, 8) for c in (1, 2)]
    for c in r["cells"]:
        assert c["lossless"] == 1.0 and c["reps"] == 2 and c["spread"]["tok_s"]["n"] == 2 and c["spread"]["t_ar_ms"]["n"] == 2
        if c["block_size"] == 4:
            assert set(c["width_histogram"]) == {"3"}
        if c["block_size"] == "auto":
            assert set(map(int, c["width_histogram"])) <= set(range(8))
    assert r["cells"][-1]["options"] == "grouped_moe,union_moe"          # that lever off, the other adopted ones on
    rows = r["projection"]["rows"]
    assert {x["setting"] for x in rows} == {"stock", "graph_draft_swa=off"}
    assert {x["name"] for x in rows} == {"DF-8", "tau 3@8"}                      # DF-16 needs w = 15: not measured
    assert all(x["policy_speedup"] >= x["default_speedup"] * (1 - 1e-9) for x in rows)
    assert "geometric" in r["projection"]["assumption"]
    for a in (c for c in r["cells"] if c["block_size"] == "auto"):       # paired within its concurrency and lever
        p = a["auto_over_best_fixed"]
        best = max((c for c in r["cells"] if c["block_size"] in (4, 8) and c["concurrency"] == a["concurrency"]
                    and c.get("lever") == a.get("lever")), key=lambda c: c["tok_s"])
        assert p["block_size"] == best["block_size"] and p["n"] == 2 and len(a["tok_s_reps"]) == 2
        assert p["ratios"] == pytest.approx([u / v for u, v in zip(a["tok_s_reps"], best["tok_s_reps"])])
    out = capsys.readouterr().out
    assert "policy/defaults" in out and "[graph_draft_swa=off]" in out and "auto" in out
    assert "auto / best fixed block, paired per repetition, median (min-max): c=1: " in out and "+graph_draft_swa=off" in out
    assert (tmp_path / "o" / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_timing_only_keeps_costs_and_drops_auto_tau_and_losslessness(tmp_path):
    from toolkit.benchmark.grid import is_synthetic

    r = bench(BenchOptions(backend="torch", block_sizes=["auto", 4], concurrency=[1], max_new_tokens=6, limit=1, reps=2,
              out=str(tmp_path / "o"), warmup=False, quiet=True, timing_only=True))
    assert r["timing_only"] is True and r["block_sizes"] == [4]
    (c,) = r["cells"]
    assert c["tau"] is None and c["lossless"] is None and c["accept_per_position"] == [] and c["round_ms"] > 0
    assert c["t_ar_ms"] > 0 and c["spread"]["round_ms"]["n"] == 2
    synth = tmp_path / "synth"
    synth.mkdir()
    (synth / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3", "synthetic": {"tool": "toolkit.synth"}}}))
    assert is_synthetic(None, synth) and not is_synthetic(tmp_path)


def test_bad_block_sizes_and_levers_are_one_line(tmp_path):
    with pytest.raises(ToolkitError, match=r"--block-sizes must be integers >= 2 or auto, got \[1\]"):
        bench(BenchOptions(block_sizes=[1], out=str(tmp_path / "x")))
    with pytest.raises(ToolkitError, match="--levers are exllamav3 generator options"):
        bench(BenchOptions(levers=["graph_draft_swa=off"], out=str(tmp_path / "x")))
    with pytest.raises(ToolkitError, match="--reps must be >= 1"):
        bench(BenchOptions(reps=0, out=str(tmp_path / "x")))
    with pytest.raises(ToolkitError, match=r"--block-sizes must be integers >= 2 or auto, got \['auto', 'x'\]"):
        main(["--block-sizes", "auto", "x"])
    assert not (tmp_path / "x").exists()


def test_minutes_stops_after_the_last_repetition_that_fits(tmp_path, capsys):
    r = bench(BenchOptions(backend="torch", block_sizes=[4], concurrency=[1], max_new_tokens=6, limit=1, reps=500, minutes=1e-4,
              out=str(tmp_path / "o"), warmup=False, quiet=True))
    assert r["reps"] == 1 and r["reps_planned"] == 500          # the first repetition always runs, then the budget ends
    assert all(c["reps"] == 1 for c in r["ar"] + r["cells"])
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["reps"] == 1
    from toolkit.bench import print_table

    print_table(r)
    assert "1 repetition(s) (of 500: --minutes ran out)" in capsys.readouterr().out
    full = bench(BenchOptions(backend="torch", block_sizes=[4], concurrency=[1], max_new_tokens=6, limit=1, reps=2, minutes=10,
                 out=str(tmp_path / "p"), warmup=False, quiet=True))
    assert full["reps"] == full["reps_planned"] == 2
    with pytest.raises(ToolkitError, match="--minutes must be > 0"):
        bench(BenchOptions(minutes=0, out=str(tmp_path / "q")))


def test_limit_takes_prompts_round_robin_over_categories():
    from toolkit.assets.prompts import Prompt, mixed

    ps = [Prompt("a1", "a"), Prompt("a2", "a"), Prompt("a3", "a"), Prompt("b1", "b"), Prompt("c1", "c")]
    assert [p.text for p in mixed(ps, 4)] == ["a1", "b1", "c1", "a2"]
    assert [p.text for p in mixed(ps, 99)] == ["a1", "b1", "c1", "a2", "a3"]


def test_a_cell_that_never_drafted_has_no_speedup(capsys):
    """An auto cell the policy ran all as plain AR: speedup null with the reason, out of `best`, said in the table."""
    from toolkit.bench import best_per_concurrency, mark_ratios, print_table

    ar = [{"concurrency": 1, "tok_s": 50.0, "tok_s_reps": [50.0, 40.0], "round_ms": 2.0}]
    cells = [{"concurrency": 1, "block_size": "auto", "tok_s": 60.0, "tok_s_reps": [60.0, 41.0], "speedup": 1.2,
              "width_histogram": {0: 30}, "tau": 1.0, "lossless": 1.0, "accept_per_position": [], "round_ms": 2.0},
             {"concurrency": 1, "block_size": 16, "tok_s": 45.0, "tok_s_reps": [45.0, 44.0], "speedup": 0.9,
              "width_histogram": {15: 10}, "tau": 2.0, "lossless": 1.0, "accept_per_position": [0.5], "round_ms": 4.0}]
    mark_ratios(ar, cells)
    auto, fixed = cells
    assert auto["speedup"] is None and "plain AR" in auto["speedup_reason"] and "speedup" not in auto.get("spread", {})
    assert fixed["spread"]["speedup"]["min"] == pytest.approx(0.9) and fixed["spread"]["speedup"]["max"] == pytest.approx(1.1)
    assert best_per_concurrency(ar, [c for c in cells if c["speedup"] is not None]) == [
        {"concurrency": 1, "block_size": None, "speedup": 1.0}]
    print_table({"backend": "torch", "target": "t", "draft": "d", "reps": 2, "ar": ar, "cells": cells, "best": []})
    out = capsys.readouterr().out
    assert "no ratio, auto c=1: every round was plain AR" in out and "B=16 c=1: 0.90-1.10x" in out
    assert "1.20x" not in out
    assert fixed["speedup"] == pytest.approx(0.9) and fixed["pair"] == {"rep": 0, "tok_s": 45.0, "ar_tok_s": 50.0}
