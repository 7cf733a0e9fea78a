"""New (jobs, width) shapes on exllamav3 (exl3_policy.BatchPolicy, exl3_hook's shape count): exllamav3 runs a new
shape eagerly, captures its CUDA graphs, then replays them, so a width not yet run at the current job count costs
its warm-up rounds once. The policy charges them to that width over the rounds ahead; scripted first, then
decode_many end to end on the stand-in Generator (tests/exl3_fakes.py) with answers that end one by one."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from exl3_fakes import Clock, FakeGenerator, V, ar_reference, make_backend

from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round, tokens_of
from toolkit.exl3.options import ADOPTED
from toolkit.policy.batch import HORIZON, NEW_SHAPE_PRIOR, NEW_SHAPE_ROUNDS, BatchPolicy
from toolkit.policy.policy import CostTable

B = 16
FLAT = CostTable({4: {0: 16.0, 1: 18.0, 3: 18.0, 7: 18.0, 15: 18.0}})


def confident(shapes: Counter | None, accept: float | None = None) -> BatchPolicy:
    """A policy at 4 jobs whose drafter has been right on its whole block (or, with `accept`, whose expected tokens
    are those of that per-position acceptance): the widest width wins when warm."""
    p = BatchPolicy(B, FLAT, concurrency=4, shapes=shapes)
    for _ in range(40):
        p.acceptance.update(B - 1)
    if accept is not None:
        p.acceptance.expected_tokens = lambda: [sum(accept ** i for i in range(w + 1)) for w in range(B)]
    p.use_concurrency(4)
    return p


def test_a_width_whose_shape_never_ran_pays_its_warm_up_rounds_spread_over_the_rounds_ahead():
    shapes = Counter({(4, 3): NEW_SHAPE_ROUNDS})
    p = confident(shapes, accept=0.8)
    E, prior = p.acceptance.expected_tokens(), NEW_SHAPE_PRIOR * 18.0
    assert p.warmup_ms(3) == 0.0 and p.warmup_ms(15) == pytest.approx(prior)
    assert p.past == NEW_SHAPE_ROUNDS                       # the rounds that warmed w=3 ran at this job count
    assert p.scores()[15] == pytest.approx(E[15] / (18.0 + prior / (HORIZON + NEW_SHAPE_ROUNDS)))
    assert p.best() == 15                                   # a long way to go: the capture pays for itself
    p.current = 3
    p.use_concurrency(4, left=4)                            # the closest job ends within a round of w=15
    rounds = 4 / E[15] + NEW_SHAPE_ROUNDS
    assert p.scores()[15] == pytest.approx(E[15] / (18.0 + prior / rounds))
    assert p.best() == 3
    shapes[4, 15] = 1                                       # its eager round ran: two warm-up rounds left
    p.use_concurrency(4, left=4)
    assert p.warmup_ms(15) == pytest.approx(prior * 2 / NEW_SHAPE_ROUNDS)
    shapes[4, 15] = NEW_SHAPE_ROUNDS
    assert p.warmup_ms(15) == 0.0 and p.best() == 15
    assert confident(None).warmup_ms(15) == 0.0             # no shape count: every shape is taken as warm


def test_a_job_count_that_keeps_coming_back_makes_a_new_shape_cheap():
    shapes = Counter({(4, 3): 200})                         # one job count, 200 rounds so far (a chat app's one job)
    p = confident(shapes, accept=0.8)
    p.current = 3
    p.use_concurrency(4, left=4)
    assert p.past == 200 and p.best() == 15
    shapes[3, 3] = NEW_SHAPE_ROUNDS                         # another job count knows none of those rounds
    p.use_concurrency(3, left=4)
    assert p.past == NEW_SHAPE_ROUNDS and p.best() == 3


def test_the_warm_up_cost_is_learnt_from_the_first_rounds_of_new_shapes():
    shapes = Counter()
    p = confident(shapes)
    for w, ms in ((3, 80.0), (3, 76.0), (3, 18.0), (7, 90.0)):
        shapes[4, w] += 1                                   # the Generator counts the round before the policy sees it
        p.width()
        p.asked = w
        p.observe_round([(j, (), Round((), 0, 1, 0.0, ms)) for j in range(4)], ms)
    assert list(p.excess) == pytest.approx([62.0, 58.0, 0.0, 72.0])   # the third round of w=3 replays: not new
    assert p.warmup_ms(15) == pytest.approx(NEW_SHAPE_ROUNDS * 60.0)  # the median excess per round still to run
    assert p.cost_report()["new_shape_excess_ms"] == pytest.approx(60.0)


def test_a_job_count_change_keeps_the_width_when_every_shape_is_new():
    shapes = Counter({(4, w): NEW_SHAPE_ROUNDS for w in (0, 1, 3, 7, 15)})
    p = confident(shapes)
    p.current = 7                                           # settled at 7 (say), within the margin of 15 once cold
    p.use_concurrency(3)
    s = p.scores()
    assert all(p.warmup_ms(w) > 0 for w in p.menu)
    assert s[15] / s[7] == pytest.approx(confident(None).scores()[15] / confident(None).scores()[7])


# -- decode_many end to end: answers of different lengths, so the job count steps down -----------------------------

def capturing(ran: Counter):
    """16 ms rounds plus 0.3 ms per verified row; a (width, jobs) shape's first three rounds cost 60 ms more."""
    def cost(w: int, rows: int) -> float:
        ran[w, rows] += 1
        return 16.0 + 0.3 * w * rows + (60.0 if ran[w, rows] <= NEW_SHAPE_ROUNDS else 0.0)
    return cost


def stepping_down(monkeypatch, tmp_path, aware: bool, seed: int):
    """8 jobs that end at 3-92 tokens, decoded by `auto` after a calibration at 8 jobs; the drafter is right on a
    seeded random run of ids each round. Returns (decoding ms, shapes run while decoding, backend, rounds)."""
    clock, ran, rng = Clock(), Counter(), random.Random(seed)
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(capturing(ran)))
    monkeypatch.setattr(FakeGenerator, "good", staticmethod(lambda last, block: min(block, int(rng.expovariate(0.4)))))
    be = make_backend(monkeypatch, tmp_path / str(aware))
    be.clock = clock
    settings = GenSettings(max_new_tokens=200)
    prompts = [[s] for s in range(6, V) if len(ar_reference([s], 200)) < 200][:8]
    be.policy(settings, 8).shapes = be.shapes if aware else None
    before, t0 = set(ran), clock.t
    rounds: dict[int, list[Round]] = {}
    for i, r in be.generate_many(prompts, settings):
        rounds.setdefault(i, []).append(r)
    assert all(tokens_of(rounds[i]) == ar_reference(p, 200) for i, p in enumerate(prompts))     # lossless
    return (clock.t - t0) * 1000.0, set(ran) - before, be, prompts


def test_the_generator_counts_the_rounds_of_each_shape_calibration_included(monkeypatch, tmp_path):
    ms, new, be, prompts = stepping_down(monkeypatch, tmp_path, True, 0)
    lengths = sorted({len(ar_reference(p, 200)) for p in prompts})
    assert len(lengths) == 8                                 # the job count steps down one by one
    assert all(be.shapes[8, w] >= NEW_SHAPE_ROUNDS for w in (0, 1, 3, 5, 7))   # the calibration's (warm + timed)
    assert {j for j, _ in be.shapes} == set(range(2, 9))     # the last two jobs end in the same round
    assert {(j, w) for w, j in new} <= set(be.shapes)        # every shape the stand-in ran was counted
    assert be.policies[(True, ADOPTED.tag)].cost_report()["new_shape_excess_ms"] > 30.0


def test_charging_new_shapes_makes_the_step_down_faster_and_never_slower(monkeypatch, tmp_path):
    """2026-12-05 (H200, c=8): `auto` ran 0.46x B=16 in a cold first repetition while it tried 6 widths at each
    job count of 8, 6, 4 and 2; each new shape's first rounds ran eagerly and captured graphs."""
    aware, blind = [], []
    for seed in range(3):
        aware.append(stepping_down(monkeypatch, tmp_path / f"a{seed}", True, seed)[:2])
        blind.append(stepping_down(monkeypatch, tmp_path / f"b{seed}", False, seed)[:2])
    for (ms_a, new_a), (ms_b, new_b) in zip(aware, blind):
        assert ms_a <= ms_b * 1.001 and len(new_a) <= len(new_b)
    assert sum(ms for ms, _ in aware) < 0.95 * sum(ms for ms, _ in blind)


@pytest.mark.parametrize("seed", range(4))
def test_at_one_job_count_the_charge_soon_fades_and_costs_nothing(seed):
    """The single-job simulations of test_exl3_learned_costs (GpuRounds: a new width's first rounds 40 ms, later
    ones 16-21 ms) with the shapes counted as the Generator would: within 1 % of the uncharged policy."""
    from test_exl3_learned_costs import TABLE as STEEP, GpuRounds, simulate, tokens_per_ms

    dear = CostTable({1: {w: 2 * (16.0 + 0.3 * w) for w in (0, 1, 3, 5, 7, 11, 15)}})
    for table in (dear, STEEP):
        blind = simulate(BatchPolicy(B, table), GpuRounds(seed), 600, seed)
        p = BatchPolicy(B, table, shapes=Counter())
        observe = p.observe_round
        p.observe_round = lambda items, ms=None: (p.shapes.update([(1, p.asked)]), observe(items, ms))
        charged = simulate(p, GpuRounds(seed), 600, seed)
        assert sum(p.shapes.values()) == 600
        assert tokens_per_ms(charged) >= 0.99 * tokens_per_ms(blind)
