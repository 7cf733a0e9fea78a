"""The drafting policy against the pair bench, replayed on the CPU over committed device traces (tests/replay.py).

Targets: `auto` within 3 % of the best fixed width and at least 0.98 of AR at c = 1, 4 and 8 on every trace; with
a drafter that accepts nothing, within 5 % of AR even when the speculative engine's AR rounds cost 20 % more than
plain ones (whole requests then decode without the drafter), and each mechanism that pays shows it.

The newest device run (`noisy`: an H100 with slow stretches, 12 % of its rounds >= 1.4x their shape's median, up
to 118 rounds long) is replayed with its noise in time: there `auto` stays well above AR but reads 0.960 / 0.966 /
1.03 of the best fixed width at c = 1 / 4 / 8, a known gap (the device itself read 0.89 / 0.89 / 0.93 of B=8,
paired). Expiring stale width costs and a switch margin were tried against it; neither paid over all traces.
"""

from __future__ import annotations

import functools
import statistics

import pytest

import replay as R

LENGTHS = R.load(R.DATA / "lengths_smollm2.json.gz")
FIRST4 = dict(LENGTHS, prompts=LENGTHS["prompts"][:4])      # the bench's --limit 4 runs
TRACES = {"call4": (FIRST4, [1, 4, 8]), "call6": (LENGTHS, [4, 8]), "call9": (LENGTHS, [4, 8]),
          "call10": (FIRST4, [1, 4, 8]), "call13": (FIRST4, [1])}
SEEDS = range(6)


def mean_ratios(name: str, lengths: dict | None = None, **kw) -> dict[int, dict[str, float]]:
    """auto over the best fixed width and over AR per concurrency, the mean over seeds of the paired medians."""
    data, cs = TRACES[name]
    costs = R.load(R.DATA / f"costs_h100_{name}.json.gz")
    runs = [R.replay(lengths or data, costs, cs, reps=10, seed=s, **kw) for s in SEEDS]
    return {c: {k: statistics.mean(r[c][k] for r in runs) for k in ("auto_over_best", "auto_over_ar")} for c in cs}


@pytest.mark.parametrize("name", TRACES)
def test_auto_holds_the_targets_on_every_trace(name):
    for c, r in mean_ratios(name).items():
        assert r["auto_over_best"] >= 0.97, (name, c, r)
        assert r["auto_over_ar"] >= 0.98, (name, c, r)


@functools.cache
def noisy_ratios() -> dict[int, dict[str, float]]:
    costs = R.load(R.DATA / "costs_h100_noisy.json.gz")
    runs = [R.replay(FIRST4, costs, [1, 4, 8], reps=10, seed=s, timed_noise=True) for s in SEEDS]
    return {c: {k: statistics.mean(r[c][k] for r in runs) for k in ("auto_over_best", "auto_over_ar")} for c in (1, 4, 8)}


def test_auto_beats_ar_on_the_noisy_device_run():
    for c, r in noisy_ratios().items():
        assert r["auto_over_ar"] >= 1.2, (c, r)


@pytest.mark.xfail(strict=True, reason="known gap: costs learnt in a slow stretch keep a width out; see module docstring")
def test_auto_within_3pct_of_the_best_fixed_width_on_the_noisy_device_run():
    for c, r in noisy_ratios().items():
        assert r["auto_over_best"] >= 0.97, (c, r)


def test_timed_noise_plays_the_device_series_back():
    data = R.load(R.DATA / "costs_h100_noisy.json.gz")
    costs = R.Costs(data, timed_noise=True)
    got = [costs.round_ms(1, 7, 0) for _ in range(5)]
    med = costs.shape_median(1, 7)
    assert got == pytest.approx([med * data["noise"][k] for k in range(1, 6)])
    with pytest.raises(ValueError, match="no noise"):
        R.Costs(R.load(R.DATA / "costs_h100_call4.json.gz"), timed_noise=True)


def test_trying_near_best_widths_pays_where_the_table_misleads():
    """call4's table rises from w=3 to 15 while the traced rounds are cheapest at w=7: without trying unseen
    near-best widths the policy never finds it."""
    assert mean_ratios("call4", explore=0.0)[1]["auto_over_best"] < 0.96 < mean_ratios("call4")[1]["auto_over_best"]


def useless(lengths: dict) -> dict:
    return dict(lengths, prompts=[dict(p, lengths=[0] * len(p["lengths"])) for p in lengths["prompts"]])


def test_a_drafter_that_accepts_nothing_costs_little_over_ar():
    """Every proposal rejected, AR rounds of a speculative request 20 % dearer: requests settle on AR and the
    next ones decode without the drafter, so `auto` stays near AR."""
    for c, r in mean_ratios("call4", useless(FIRST4), spec_ar=1.2).items():
        assert r["auto_over_ar"] >= 0.95, (c, r)


def test_plain_requests_pay_when_ar_rounds_of_the_speculative_engine_cost_more(monkeypatch):
    with_plain = mean_ratios("call4", useless(FIRST4), spec_ar=1.2)
    monkeypatch.setattr(R.Policy, "plain", lambda self, jobs: False)
    without = mean_ratios("call4", useless(FIRST4), spec_ar=1.2)
    for c in with_plain:
        assert with_plain[c]["auto_over_ar"] > without[c]["auto_over_ar"] + 0.05, (c, with_plain[c], without[c])


def test_fixed_widths_replay_their_tokens():
    costs = R.Costs(R.load(R.DATA / "costs_h100_call4.json.gz"))
    row = {"answer": list(range(40)), "lengths": [3] * 39}
    tokens, ms = R.replay_request([row], 40, 7, None, costs, 15, host_ms=0.0, switch_ms=0.0)
    assert tokens == 40 and ms > 0                         # 1 at prefill, then rounds of 4 (3 accepted + 1), capped
    ar_tokens, ar_ms = R.replay_request([row], 40, 0, None, costs, 15, host_ms=0.0, switch_ms=0.0)
    assert ar_tokens == 40 and ar_ms > ms
