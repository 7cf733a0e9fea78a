"""The drafting policy: width arithmetic, hindsight acceptance, probing, the cost cache; tests/test_policy_backend.py
has it on the tiny pair and as the torch backend's default."""

import json
import math

import pytest
import torch

from policy_fakes import B, Forced, Scripted, linear, truth
from toolkit.runtime.events import Round, summarize, tokens_of
from toolkit.runtime.loop import decode
from toolkit.policy.chooser import MIN_GAP, PROBE_BUDGET, Policy
from toolkit.costs.cache import COST_CACHE_ENV, cached_costs, cost_dir, cost_key
from toolkit.costs.table import CostTable, interpolate
from toolkit.runtime.sampling import Sampler


def learn(p: Policy, length: int, n: int = 1) -> None:
    """n proposals of full-width length `length`, resolved in rounds of one job."""
    for _ in range(n):
        p.learn(length, p.fade(1))


def run(policy, good, max_new):
    return list(decode(Scripted(good), [1, 2, 3], max_new, Sampler(), set(), policy=policy))


# -- (a) arithmetic ----------------------------------------------------------------------------------------------

def test_scores_are_expected_tokens_over_cost():
    p = Policy.auto(4, linear(10, 20, 2, block=4))
    assert p.expected_tokens() == [1, 1, 1, 1]                      # nothing seen yet
    learn(p, 2, 200)
    assert p.expected_tokens() == pytest.approx([1, 2, 3, 3], abs=1e-4)
    assert p.scores() == pytest.approx({0: 1 / 10, 1: 2 / 22, 2: 3 / 24, 3: 3 / 26}, abs=1e-5)
    assert p.best() == 2


@pytest.mark.parametrize("L, costs, want", [
    (15, linear(10, 10.5, 0.5), 15),      # everything accepted and verifying is cheap: full width
    (0, linear(10, 11, 0.1), 0),          # nothing accepted: AR, the drafter is never worth it
    (15, linear(10, 40, 20), 0),          # all accepted but each verified draft costs 2 AR steps: AR
    (3, linear(10, 10, 2), 3),            # exactly 3 accepted: verify 3, more only adds cost
    (6, linear(10, 30, 0.5), 6),
])
def test_width_follows_acceptance_and_costs(L, costs, want):
    p = Policy.auto(B, costs)
    learn(p, L, 300)
    assert p.rates == pytest.approx([1.0] * L + [0.0] * (B - 1 - L), abs=1e-5)
    assert p.best() == want and p.width() == want


def test_expensive_drafter_falls_back_to_ar_after_one_proposal():
    p = Policy.auto(B, linear(10, 100, 1))         # a full block costs 10 AR steps: only near-full acceptance pays
    p.start(0, 0)
    assert p.best() == 0 and p.width() == B - 1    # nothing known: AR wins, but a fresh policy probes once
    learn(p, 4)
    assert p.width() == 0


def test_fixed_policy_keeps_its_width_and_drafts_only_that():
    p = Policy.fixed(5)
    assert p.draft_len == 5 and all(p.width() == 5 for _ in range(3))
    assert Policy.fixed(0).width() == 0
    auto = Policy.auto(8, linear(10, 11, 1, block=8))
    assert auto.draft_len == 7
    with pytest.raises(ValueError):
        Policy.auto(8, None)
    with pytest.raises(ValueError):
        Policy(4, fixed_width=4)


def test_cost_curve_interpolates_and_is_monotone():
    t = CostTable({1: {0: 10, 1: 12, 5: 20}})
    assert t.curve(8) == pytest.approx([10, 12, 14, 16, 18, 20, 22, 24])      # linear, then the last slope
    t = CostTable({1: {0: 10, 2: 15, 4: 13}})
    assert t.curve(6) == pytest.approx([10, 14, 14, 14, 14, 14])              # a dearer narrower width is pooled
    t = CostTable({1: {0: 19, 1: 19, 3: 25, 5: 18, 7: 18.5, 11: 18.5, 15: 19}})     # one slow width (H100, 2026-12-05)
    assert max(t.curve(16)) < 21 and all(a <= b for a, b in zip(t.curve(16), t.curve(16)[1:]))
    assert CostTable({1: {0: 10, 1: 8}}).curve(3) == pytest.approx([10, 10, 10])  # drafting never beats AR's cost
    t = CostTable({1: {0: 1, 1: 2}, 4: {0: 3, 1: 4}})
    assert t.curve(2, concurrency=3) == [3, 4] and t.curve(2, concurrency=2) == [1, 2]
    assert interpolate([(3, 7.0)], 9) == 7.0


@pytest.mark.parametrize("bad", [{}, {1: {1: 2.0}}, {1: {0: 1.0}}, {1: {0: 1.0, 1: -2.0}}, {0: {0: 1, 1: 2}}])
def test_cost_table_rejects_bad_tables(bad):
    with pytest.raises(ValueError):
        CostTable(bad)


# -- (b) hindsight acceptance ------------------------------------------------------------------------------------

def test_hindsight_resolves_full_width_lengths_from_later_rounds():
    p = Policy.auto(5, linear(10, 20, 1, block=5))
    p.start("j", 5)                                         # the stream goes 5, 6, 7, 8, 1, 2, 3, 4
    assert p.resolve("j", (6, 7, 8, 9), [6, 7]) == []       # verified 1 of 4: 6 accepted, 7 the bonus; 8, 9 unknown
    assert p.resolve("j", (), [8]) == []                    # an AR round confirms 8; position 4 still unknown
    assert p.resolve("j", (9, 2, 3), [1]) == [3, 0]         # 1 != 9 resolves the first (L=3) and the new one (L=0)
    assert p.resolve("j", (2, 3), [2, 3, 4]) == [2]         # all confirmed
    assert p.resolve("j", (4, 4), []) == [] and len(p.jobs["j"][1]) == 1
    assert p.resolve("other", (1, 2), [1]) == []            # a job the policy was not told of teaches nothing


def test_hindsight_learns_every_position_while_verifying_only_one():
    good = 5
    p = Forced([1])                               # verify 1 draft per round, draft all 15
    rounds = run(p, lambda n: good, 201)           # 1 + 100 rounds of 2: none clipped
    assert all(len(r.drafted) == 1 and r.proposed == B - 1 for r in rounds[1:])
    assert tokens_of(rounds) == [truth(i) for i in range(201)]
    assert p.count == len(rounds) - 1 - 2              # L = 5 is known at the 6th token: the last 2 proposals wait
    assert p.jobs == {}                                # the answer ended: its pending proposals are dropped
    assert p.rates == pytest.approx([1.0] * good + [0.0] * (B - 1 - good), abs=0.02)
    assert summarize(rounds).accept_per_position == [1.0]          # what was verified: position 1 only


def test_summary_acceptance_counts_only_rounds_that_verified_the_position():
    rounds = [Round((), 0, 1, prefill=True), Round((1, 2, 3), 3, 4, proposed=7), Round((5,), 0, 6, proposed=7),
              Round((), 0, 7, proposed=0)]
    s = summarize(rounds)
    assert s.accept_per_position == [0.5, 1.0, 1.0] and s.rounds == 2 and s.tau == 2.5
    assert rounds[2].proposed == 7 and Round((1, 2), 1, 3).proposed == 2
    assert Round.from_json(rounds[1].to_json()) == rounds[1]
    old = {k: v for k, v in rounds[1].to_json().items() if k != "proposed"}       # a stream saved before the field
    assert Round.from_json(old).proposed == 3
    with pytest.raises(ValueError):
        Round((1, 2), 0, 3, proposed=1)


# -- (c) probing -------------------------------------------------------------------------------------------------

def probes(rounds):
    return [i for i, r in enumerate(rounds) if r.drafted]


def test_probes_cost_at_most_the_budget_of_ar_time():
    costs = linear(10, 40, 1)                     # a full-width round costs 5.5 AR steps; nothing is ever accepted
    p = Policy.auto(B, costs)
    rounds = run(p, lambda n: 0, 6000)[1:]
    g = p.gap(1)
    assert g == math.ceil((5.5 - p.expected_tokens()[-1]) / PROBE_BUDGET) and 145 <= g <= 150   # the prior faded
    at = probes(rounds)
    gaps = [b - a - 1 for a, b in zip([-1] + at, at)]
    assert gaps[0] == 0                                      # a fresh policy learns from a proposal at once ...
    assert g == 150 and set(gaps[1:]) == {g}                 # ... then (55 - 10) / 10 AR steps beyond, 3 % of AR time
    assert all(len(rounds[i].drafted) == B - 1 for i in at)
    t = costs.curve(B)
    steady = rounds[at[3] + 1:]
    spent = sum(t[len(r.drafted)] for r in steady)
    assert spent / (len(tokens_of(steady)) * t[0]) - 1 <= PROBE_BUDGET


def test_probing_sees_acceptance_come_back():
    switch = 2000                                 # the drafter is useless for 2000 tokens, then always right
    p = Policy.auto(B, linear(10, 14, 0.2))       # a full-width round costs 1.7 AR steps
    rounds = run(p, lambda n: 0 if n < switch else B, 4000)[1:]
    first = next(i for i, r in enumerate(rounds) if sum(len(x.tokens) for x in rounds[: i + 1]) > switch)
    before = [i for i in range(first) if rounds[i].drafted]
    assert all(b - a > MIN_GAP for a, b in zip(before, before[1:]))          # only probes while the drafter fails
    spec = [i for i in range(first, len(rounds)) if rounds[i].drafted]
    assert spec[0] - first <= math.ceil((1.7 - 1) / PROBE_BUDGET) + 1           # the next probe at worst
    assert all(rounds[i].drafted for i in range(spec[0], len(rounds)))       # one probe turns the estimate
    assert len(rounds[-2].drafted) == B - 1


def test_a_fresh_policy_drafts_from_its_first_round():
    p = Policy.auto(B, linear(10, 14, 0.2))        # drafting pays once the drafter is known to be right
    rounds = run(p, lambda n: B, 60)[1:]
    assert all(r.drafted for r in rounds[:10])      # the first round probes; its proposal shows the drafter right


def test_a_fresh_policy_does_not_probe_where_no_width_could_pay():
    p = Policy.auto(B, linear(10, 200, 1))          # even a fully accepted block costs more than its 16 AR steps
    assert not any(r.drafted for r in run(p, lambda n: B, 60)[1:])


# -- (d) cost cache ----------------------------------------------------------------------------------------------

def test_cost_cache_round_trip_and_corrupt_file(tmp_path, monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return CostTable({1: {0: 1.5, 3: 4.0}}, device="test", counts={1: {0: 5, 3: 5}})

    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path / "c"))
    assert cost_dir() == tmp_path / "c"
    a = cached_costs("k1", measure)
    b = cached_costs("k1", measure)
    assert a == b and b.ms == {1: {0: 1.5, 3: 4.0}} and b.device == "test" and len(calls) == 1
    for junk in ("{not json", json.dumps({"ms": {"1": {"2": 3}}}), json.dumps([1, 2]), ""):
        (tmp_path / "c" / "k1.json").write_text(junk)
        assert cached_costs("k1", measure) == a
    assert len(calls) == 5 and CostTable.from_json(json.loads((tmp_path / "c" / "k1.json").read_text())) == a
    cached_costs("k1", measure, refresh=True)
    assert len(calls) == 6


def test_a_cached_table_that_no_longer_holds_is_timed_again(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return CostTable({1: {0: 10.0, 15: 30.0}}, counts={1: {0: 5, 15: 5}})

    cached_costs("k", measure, tmp_path)
    same = cached_costs("k", measure, tmp_path, check=lambda: {1: {0: 12.0, 15: 22.0}})      # within x1.5: kept
    assert same.source.startswith("cached") and len(calls) == 1
    slower = cached_costs("k", measure, tmp_path, check=lambda: {1: {0: 27.0, 15: 30.0}})   # the AR step 2.7x dearer now
    assert len(calls) == 2 and slower.source == "timed now (the cached AR step took 10 ms, now 27 ms)"
    off = cached_costs("k", measure, tmp_path, check=lambda: {1: {0: 10.0, 15: 150.0}})     # drafting 5x dearer
    assert len(calls) == 3 and "15-draft round took 30 ms, now 150 ms" in off.source
    assert cached_costs("k", measure, tmp_path, check=lambda: {1: {7: 1.0}}).source.startswith("cached")  # no common width


def test_cost_key_follows_configs_device_dtype_and_block(pair):
    t, d = pair
    k = cost_key([t, d], "cpu", torch.float32, 16)
    assert k == cost_key([t, d], "cpu", torch.float32, 16)
    assert len({k, cost_key([t], "cpu", torch.float32, 16), cost_key([t, d], "cpu", torch.bfloat16, 16),
                cost_key([t, d], "cpu", torch.float32, 8)}) == 4
