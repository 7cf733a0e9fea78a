"""Round costs learnt online by the exllamav3 drafting policy (runtime/learned_costs.py, exl3_policy.BatchPolicy):
scripted cost and acceptance streams against a steep calibrated table, then decode_many end to end on the
stand-in Generator (tests/exl3_fakes.py) with a calibration that is steeper than its decoding rounds."""

from __future__ import annotations

import itertools
import random

import pytest
from exl3_fakes import Clock, FakeGenerator, V, ar_reference, make_backend

from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round, tokens_of
from toolkit.runtime.exl3_policy import BatchPolicy
from toolkit.runtime.learned_costs import LearnedCosts, cost_report
from toolkit.runtime.policy import CostTable

B = 16


def steep(w: int) -> float:
    """The calibrated table of the brief: w=3 15 ms, w=15 25 ms (linear), an AR step 13 ms."""
    return 13.0 if w == 0 else 15.0 + (w - 3) * 10.0 / 12.0


def flat(w: int) -> float:
    return 16.0 if w == 0 else 18.0


TABLE = CostTable({1: {w: steep(w) for w in (0, 1, 3, 5, 7, 11, 15)}})


def drive(policy: BatchPolicy, cost, rounds: int, seed: int, accept: float = 0.7) -> list[int]:
    """One job for `rounds` iterates: the drafter's full-width accepted length is geometric (`accept` per position,
    seeded), each iterate takes cost(asked width) ms; returns the widths the policy asked for."""
    rng, nxt, widths = random.Random(seed), 100, []
    policy.begin_job(0, nxt - 1)
    for _ in range(rounds):
        policy.use_concurrency(1)
        w = policy.width()
        L = 0
        while L < B - 1 and rng.random() < accept:
            L += 1
        proposal = tuple(nxt + j if j < L else -1 for j in range(B - 1))    # right on its first L ids
        if w:
            a = min(L, w)
            rnd = Round(proposal[:w], a, nxt + a, 1.0, cost(w) - 1.0, proposed=B - 1)
        else:
            a, rnd = 0, Round((), 0, nxt, 0.0, cost(0))
        nxt += a + 1
        policy.observe_round([(0, proposal if w else (), rnd)], cost(w))
        widths.append(w)
    return widths


# -- the learned curve ------------------------------------------------------------------------------------------

def test_the_table_holds_until_a_width_has_three_rounds_and_one_slow_round_moves_nothing():
    prior = [steep(w) for w in range(B)]
    lc = LearnedCosts()
    for ms in (18.0, 18.0):
        lc.observe(1, 4, ms)
    assert lc.curve(1, prior) == prior                               # two rounds: still the table
    lc.observe(1, 4, 90.0)                                           # a third, slow (another process)
    assert lc.settled(1) == {4: 18.0}                                 # median of 18, 18, 90
    lc.observe(1, 4, 18.0)
    assert lc.curve(1, prior)[4] == 18.0 and lc.curve(1, prior)[0] == prior[0]    # AR learns on its own
    assert lc.curve(2, prior) == prior                               # other concurrencies are their own


def test_a_flat_observed_curve_flattens_a_steep_table_and_the_curve_never_falls():
    prior = [steep(w) for w in range(B)]
    lc = LearnedCosts()
    for w in (3, 12):
        for _ in range(3):
            lc.observe(1, w, 18.0)
    t = lc.curve(1, prior)
    assert t[3:13] == [18.0] * 10                                     # between the settled widths: flat
    assert t[1] == pytest.approx(prior[1] * 18.0 / prior[3])          # beyond them: the table at the nearest's ratio
    assert t[15] == pytest.approx(prior[15] * 18.0 / prior[12]) and t[15] < prior[12]
    assert all(a <= b for a, b in zip(t, t[1:]))
    for _ in range(3):
        lc.observe(1, 7, 30.0)                                       # one width dearer than a wider one
    t = lc.curve(1, prior)
    assert t[7] == 30.0 and t[12] == t[15] == 30.0 and all(a <= b for a, b in zip(t, t[1:]))


def test_a_width_not_picked_again_follows_its_cheap_neighbours_once_stale():
    prior = [steep(w) for w in range(B)]
    lc = LearnedCosts(stale_after=100)
    for _ in range(3):
        lc.observe(1, 15, 60.0)                                      # a spike while w=15 was tried
    for _ in range(50):
        lc.observe(1, 12, 18.0)
    assert lc.curve(1, prior)[15] == 60.0                            # still what it was seen to cost...
    for _ in range(60):
        lc.observe(1, 12, 18.0)
    t = lc.curve(1, prior)
    assert 15 not in lc.settled(1) and t[15] == pytest.approx(prior[15] * 18.0 / prior[12])   # ...not forever
    assert lc.observed(1)[15] == {"ms": 60.0, "rounds": 3}


# -- the policy on scripted streams ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_rounds_that_cost_the_same_at_every_width_move_the_policy_wide(seed):
    p = BatchPolicy(B, TABLE)
    widths = drive(p, flat, 300, seed)
    assert widths[0] <= 6                                             # the table starts it narrow
    settled = next(i for i in range(len(widths)) if all(w >= 12 for w in widths[i:i + 20]))
    assert settled <= 100 and sum(w >= 12 for w in widths[100:]) >= 0.95 * 200
    learned = cost_report(p)["learned"][1]
    assert learned[15] == pytest.approx(18.0) and learned[3] <= 18.0
    never = BatchPolicy(B, TABLE, learn_costs=False)                  # the table alone keeps it narrow
    assert max(drive(never, flat, 300, seed)[100:]) <= 8


@pytest.mark.parametrize("seed", range(4))
def test_rounds_as_steep_as_the_table_keep_it_narrow_after_a_few_probes(seed):
    p = BatchPolicy(B, TABLE)
    widths = drive(p, steep, 300, seed)
    assert sum(w == B - 1 for w in widths) <= 6                      # the wide end probed, found dear
    assert max(widths[100:]) <= 8 and sum(widths[100:]) / 200 <= 6
    assert cost_report(p)["learned"][1][15] == pytest.approx(25.0)


def test_a_flat_table_over_steep_rounds_probes_narrower_and_settles_narrow():
    table = CostTable({1: {0: 13.0, 1: 18.0, 15: 18.0}})
    p = BatchPolicy(B, table)
    widths = drive(p, steep, 300, 0)
    assert widths[0] == B - 1 and 7 in widths[:40]                    # starts wide, probes half its width
    assert sum(widths[150:]) / 150 <= 7


def test_a_fixed_width_learns_and_probes_nothing():
    p = BatchPolicy(B, TABLE, fixed_width=5)
    widths = drive(p, flat, 100, 0)
    assert widths == [5] * 100 and p.learned is None and p.t == pytest.approx([steep(w) for w in range(B)])


# -- decode_many end to end ----------------------------------------------------------------------------------------

def calibrated_steep_backend(monkeypatch, tmp_path, learn: bool):
    """A stand-in backend whose calibration sees 10 + 3 w c ms rounds, whose decoding rounds cost 14 ms at any
    width (10 for AR), and whose drafter is right on 0, 0, 1, 1, 2, 2, 3, 4, 6, 9 ids, round after round."""
    clock = Clock()
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(lambda w, rows: 10.0 + 3.0 * w * rows))
    pattern = itertools.cycle([0, 0, 1, 1, 2, 2, 3, 4, 6, 9])
    monkeypatch.setattr(FakeGenerator, "good", staticmethod(lambda last, block: next(pattern)))
    be = make_backend(monkeypatch, tmp_path)
    be.clock, be.learn_costs = clock, learn
    be.cost_table(1)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(lambda w, rows: 14.0 if w else 10.0))
    return be


@pytest.mark.parametrize("learn", [True, False])
def test_decode_many_learns_from_the_iterate_times(monkeypatch, tmp_path, learn):
    be = calibrated_steep_backend(monkeypatch, tmp_path, learn)
    p = [s for s in range(6, V) if len(ar_reference([s], 300)) == 300][0]
    rounds = list(be.generate([p], GenSettings(max_new_tokens=300)))
    assert tokens_of(rounds) == ar_reference([p], 300)
    tail = [len(r.drafted) for r in rounds[len(rounds) // 2:]]
    report = cost_report(be.policies[(True, "stock")])
    assert report["start"][1] == pytest.approx({w: 10.0 + 3.0 * w for w in range(8)})
    if learn:
        assert tail.count(7) >= 0.9 * len(tail)                      # 14 ms at any width: the widest wins
        assert report["learned"][1][7] == pytest.approx(14.0)
        assert sum(o["rounds"] for o in report["observed"][1].values()) == len(rounds) - 1   # the prefill round is not
    else:
        assert max(tail) <= 3 and report["learned"] == report["start"] and "observed" not in report
    fixed = list(be.generate([p], GenSettings(max_new_tokens=40, block_size=5)))
    assert {len(r.drafted) for r in fixed} == {4} and cost_report(be.policies[(True, "stock")]) == report
