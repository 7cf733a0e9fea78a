"""experiments/policy_replay.py: full-width lengths on the tiny pair, and the replay of the pair bench's cells."""

from __future__ import annotations

import gzip
import json
from statistics import mean

import pytest

from experiments import policy_replay as pr


def test_full_lengths_are_what_a_full_block_accepts_at_each_round_start():
    from toolkit.assets.pairs import tiny_pair
    from toolkit.runtime.backend import GenSettings
    from toolkit.runtime.torch_backend import TorchBackend, TorchSteps

    be = TorchBackend.from_dirs(*tiny_pair())
    ids = be.encode("json.dumps")
    answer = [t for r in be.generate(ids, GenSettings(max_new_tokens=40), speculative=False) for t in r.tokens]
    L = pr.full_lengths(TorchSteps(be.target, be.drafter), ids, answer, be.block_size - 1)
    assert len(L) == len(answer) - 1 and max(L) > 0
    n, checked = 0, 0
    for r in be.generate(ids, GenSettings(max_new_tokens=40, block_size=be.block_size)):   # fixed full block
        if not r.prefill and n + len(r.drafted) + 1 <= len(answer) - 1:                     # not cut by the budget
            assert r.accepted == min(L[n - 1], len(r.drafted))
            checked += 1
        n += len(r.tokens)
    assert checked >= 3


def synthetic_trace(tmp_path, per_width: float = 0.5, gz: bool = False):
    """Rounds of B=8, B=16, AR and auto cells: 10 ms + 1 ms per job + `per_width` ms per verify width."""
    rows = []
    for cell, ws in (("ar", [0]), ("8", [7]), ("16", [15]), ("auto", [3, 7, 15])):
        for c in (1, 2):
            rows.append({"cell": f"{cell}/c{c}/n96", "t": 0.0, "w": ws[0], "rows": 0, "jobs": 0, "ms": 30.0, "emitted": 0})
            for k in range(12):
                for w in ws:
                    for jobs in range(1, c + 1):
                        emitted = jobs * (1 + (k % 3 if w else 0))
                        rows.append({"cell": f"{cell}/c{c}/n96", "t": 0.0, "w": w, "rows": jobs * (w + 1), "jobs": jobs,
                                     "ms": 10.0 + jobs + per_width * w + 0.01 * emitted, "emitted": emitted})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = tmp_path / ("trace.jsonl.gz" if gz else "trace.jsonl")
    path.write_bytes(gzip.compress(text.encode())) if gz else path.write_text(text)
    return path


def bench_json(tmp_path, per_width: float = 0.5):
    start = {str(c): {str(w): 10.0 + c + per_width * w for w in range(16)} for c in (1, 2)}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"cells": [{"block_size": "auto", "costs": {"start": start}}]}))
    return path


def lengths_data(L: int, n: int = 2, tokens: int = 40) -> dict:
    return {"block_size": 16, "max_new_tokens": tokens,
            "prompts": [{"category": "x", "answer": list(range(100 * i, 100 * i + tokens)), "lengths": [L] * (tokens - 1)}
                        for i in range(n)]}


def test_trace_costs_draw_traced_shapes_and_shift_untraced_ones(tmp_path):
    costs = pr.TraceCosts(synthetic_trace(tmp_path, gz=True))
    assert costs.per_token == pytest.approx(0.01)
    assert costs.shape(1, 7) == costs.by[(1, 7)] and min(costs.shape(1, 7)) >= 13.5
    assert mean(costs.shape(1, 11)) == pytest.approx(mean(costs.shape(1, 7)) + 4 * 0.5)     # the 7 -> 15 slope per width
    assert mean(costs.shape(2, 11)) == pytest.approx(mean(costs.shape(2, 7)) + 4 * 0.5)
    assert costs.prefill_ms(1) == 30.0 and costs.prefill_ms(5) == 30.0


def test_fixed_widths_replay_their_tokens_and_costs(tmp_path):
    costs = pr.TraceCosts(synthetic_trace(tmp_path, per_width=0.0))
    rows = lengths_data(L=3)["prompts"]
    tokens, ms = pr.replay_request(rows[:1], 40, 7, None, costs, 15, host_ms=0.0, prefill_ms=0.0)
    assert tokens == 40                                    # 1 at prefill, then rounds of 4 (3 accepted + 1), capped
    rounds = -(-39 // 4)                                   # each draws a traced 11.01-11.03 ms, + 0.01 ms per extra token
    assert rounds * 11.01 + 0.01 * (39 - rounds) <= ms <= rounds * 11.03 + 0.01 * (39 - rounds)
    t_ar, ms_ar = pr.replay_request(rows[:1], 40, 0, None, costs, 15, host_ms=0.0, prefill_ms=0.0)
    assert t_ar == 40 and ms_ar == pytest.approx(39 * 11.01)


@pytest.mark.parametrize("L,expect", [(15, "draft"), (0, "ar")])
def test_the_replayed_policy_drafts_where_it_pays_and_decodes_ar_where_it_cannot(tmp_path, L, expect):
    res = pr.replay(lengths_data(L), synthetic_trace(tmp_path, per_width=0.1), bench_json(tmp_path, 0.1), [1, 2],
                    reps=3, seed=0, host_ms=0.0, auto_host_ms=0.0)
    for c in ("1", "2"):
        if expect == "draft":                              # every draft right: wide wins, auto close to the best fixed
            assert res[c]["auto_over_best"] >= 0.9 and res[c]["auto_over_ar"] > 2
        else:                                              # every draft wrong: auto stays near AR, fixed widths lose
            assert res[c]["auto_over_ar"] >= 0.9 and res[c]["8"] < res[c]["ar"]


def test_the_cli_prints_a_table_and_refuses_bad_input(tmp_path, capsys):
    data = tmp_path / "lengths.json"
    data.write_text(json.dumps(lengths_data(3)))
    trace, bench = synthetic_trace(tmp_path), bench_json(tmp_path)
    assert pr.main(["run", str(data), "--trace", str(trace), "--bench", str(bench), "--concurrency", "1", "2",
                    "--reps", "2", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| 1 |") + out.startswith("| 1 |") == 1 and "| 2 |" in out
    assert pr.main(["run", str(tmp_path / "none.json"), "--trace", str(trace), "--bench", str(bench)]) == 2
    assert pr.main(["run", str(data), "--trace", str(trace), "--bench", str(bench), "--reps", "0"]) == 2
    assert pr.main(["lengths", "--out", str(data)]) == 2                         # exists: never replaced without --force
    assert pr.main(["lengths", "--out", str(tmp_path / "x.json"), "--target", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("error: ") == 4
    assert json.loads(data.read_text()) == lengths_data(3)
