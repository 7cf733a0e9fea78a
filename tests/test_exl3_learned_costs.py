"""Round costs learnt online by the exllamav3 drafting policy (runtime/learned_costs.py, exl3_policy.BatchPolicy):
scripted cost and acceptance streams against a steep calibrated table, then decode_many end to end on the
stand-in Generator (tests/exl3_fakes.py) with a calibration that is steeper than its decoding rounds."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from exl3_fakes import Clock, FakeGenerator, V, ar_reference, make_backend

from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round, tokens_of
from toolkit.exl3.options import ADOPTED
from toolkit.policy.batch import EXPLORE_EVERY, SWITCH_MARGIN, BatchPolicy, probe_widths
from toolkit.policy.learned import MIN_SEEN, WARMUP, LearnedCosts, cost_report
from toolkit.policy.policy import CostTable

B = 16


def steep(w: int) -> float:
    """The calibrated table of the brief: w=3 15 ms, w=15 25 ms (linear), an AR step 13 ms."""
    return 13.0 if w == 0 else 15.0 + (w - 3) * 10.0 / 12.0


def flat(w: int) -> float:
    return 16.0 if w == 0 else 18.0


TABLE = CostTable({1: {w: steep(w) for w in (0, 1, 3, 5, 7, 11, 15)}})


def simulate(policy: BatchPolicy, cost, rounds: int, seed: int, accept: float = 0.7) -> list[tuple[int, int, float]]:
    """One job for `rounds` iterates: the drafter's full-width accepted length is geometric (`accept` per position,
    seeded), each iterate takes cost(asked width) ms; returns (width asked, tokens emitted, ms) per iterate."""
    rng, nxt, log = random.Random(seed), 100, []
    policy.begin_job(0, nxt - 1)
    for _ in range(rounds):
        policy.use_concurrency(1)
        w = policy.width()
        L = 0
        while L < B - 1 and rng.random() < accept:
            L += 1
        proposal = tuple(nxt + j if j < L else -1 for j in range(B - 1))    # right on its first L ids
        ms = cost(w)
        if w:
            a = min(L, w)
            rnd = Round(proposal[:w], a, nxt + a, 1.0, ms - 1.0, proposed=B - 1)
        else:
            a, rnd = 0, Round((), 0, nxt, 0.0, ms)
        nxt += a + 1
        policy.observe_round([(0, proposal if w else (), rnd)], ms)
        log.append((w, a + 1, ms))
    return log


def drive(policy: BatchPolicy, cost, rounds: int, seed: int, accept: float = 0.7) -> list[int]:
    """The widths `simulate` asked for."""
    return [w for w, _, _ in simulate(policy, cost, rounds, seed, accept)]


# -- the learned curve ------------------------------------------------------------------------------------------

def rounds(lc: LearnedCosts, c: int, w: int, *ms: float, warm: float = 45.0) -> None:
    """A stretch of rounds at (c, w): the two warm-up rounds a new stretch pays (eager run, graph capture), then `ms`."""
    for t in (warm, warm, *ms):
        lc.observe(c, w, t)


def test_the_table_holds_until_a_width_has_three_kept_rounds_and_one_slow_round_moves_nothing():
    prior = [steep(w) for w in range(B)]
    lc = LearnedCosts()
    rounds(lc, 1, 4, 18.0, 18.0)
    assert lc.curve(1, prior) == prior                               # two kept rounds: still the table
    lc.observe(1, 4, 90.0)                                           # a third, slow (another process)
    assert lc.settled(1) == {4: 18.0}                                 # the 25th percentile of 18, 18, 90
    lc.observe(1, 4, 18.0)
    rounds(lc, 1, 0, 12.0, 12.0, 12.0)
    assert lc.curve(1, prior)[4] == 18.0 and lc.curve(1, prior)[0] == 12.0    # AR learns on its own
    assert lc.curve(2, prior) == prior                               # other concurrencies are their own
    assert lc.observed(1)[4] == {"ms": 18.0, "rounds": 4, "warmup": 2}


def test_warm_up_rounds_after_a_change_of_width_or_job_count_are_not_learnt_from():
    lc = LearnedCosts()
    for _ in range(6):                                               # churn: every round is the first of its stretch
        lc.observe(1, 7, 40.0)
        lc.observe(1, 3, 40.0)
    assert lc.settled(1) == {} and lc.observed(1)[3] == {"ms": None, "rounds": 0, "warmup": 6}
    rounds(lc, 1, 7, 17.0, 17.0, 17.0)
    assert lc.settled(1) == {7: 17.0}
    rounds(lc, 2, 7, 20.0, 20.0, 20.0)                               # a job joined: (2, 7) warms up on its own
    lc.observe(1, 7, 60.0)                                           # back at one job: the first two rounds again
    lc.observe(1, 7, 60.0)
    assert lc.settled(1) == {7: 17.0} and lc.settled(2) == {7: 20.0}
    assert lc.observed(2)[7]["warmup"] == 2 and lc.observed(1)[7]["warmup"] == 10


def test_the_cost_is_the_floor_of_additive_jitter_not_its_median():
    lc = LearnedCosts()
    noisy = [16.0 + 4.8 * ((7 * i) % 16) / 15 for i in range(40)]   # a 16 ms round plus 0-30 % host noise
    rounds(lc, 1, 15, *noisy)
    kept = sorted(noisy[-16:])                                       # the window: the last 16 kept rounds
    assert kept == pytest.approx([16.0 + 4.8 * j / 15 for j in range(16)])
    assert lc.settled(1)[15] == pytest.approx(16.0 + 4.8 * 3.75 / 15)    # 17.2 ms, where the median is 18.4

def test_a_flat_observed_curve_flattens_a_steep_table_and_the_curve_never_falls():
    prior = [steep(w) for w in range(B)]
    lc = LearnedCosts()
    for w in (3, 12):
        rounds(lc, 1, w, 18.0, 18.0, 18.0)
    t = lc.curve(1, prior)
    assert t[3:13] == [18.0] * 10                                     # between the settled widths: flat
    assert t[1] == pytest.approx(prior[1] * 18.0 / prior[3])          # beyond them: the table at the nearest's ratio
    assert t[15] == pytest.approx(prior[15] * 18.0 / prior[12]) and t[15] < prior[12]
    assert all(a <= b for a, b in zip(t, t[1:]))
    rounds(lc, 1, 7, 30.0, 30.0, 30.0)                               # one width dearer than a wider one
    t = lc.curve(1, prior)
    assert t[3] == 18.0 and t[7:13] == [24.0] * 6                    # pooled with it, weighted by kept rounds
    assert t[15] == pytest.approx(prior[15] * 24.0 / prior[12]) and all(a <= b for a, b in zip(t, t[1:]))
    rounds(lc, 1, 12, *[18.0] * 6)                                   # w=12 seen three times as often as w=7
    assert lc.curve(1, prior)[7:13] == [21.0] * 6


def test_a_width_not_picked_again_follows_its_cheap_neighbours_once_stale():
    prior = [steep(w) for w in range(B)]
    lc = LearnedCosts(stale_after=100)
    rounds(lc, 1, 15, 60.0, 60.0, 60.0)                              # a spike while w=15 was tried
    rounds(lc, 1, 12, *[18.0] * 48)
    assert lc.curve(1, prior)[15] == 60.0                            # still what it was seen to cost...
    rounds(lc, 1, 12, *[18.0] * 58)
    t = lc.curve(1, prior)
    assert 15 not in lc.settled(1) and t[15] == pytest.approx(prior[15] * 18.0 / prior[12])   # ...not forever
    assert lc.observed(1)[15] == {"ms": 60.0, "rounds": 3, "warmup": 2}


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


class GpuRounds:
    """Rounds as exllamav3's on the H200 (issue 16): a 16 ms floor at every width plus 0-30 % additive host jitter,
    the first two rounds of a new width 40 ms (eager run, graph capture), a round after a width change 2 ms more."""

    def __init__(self, seed: int):
        self.rng, self.ran, self.last = random.Random(seed), Counter(), None

    def __call__(self, w: int) -> float:
        self.ran[w] += 1
        changed, self.last = w != self.last, w
        return 40.0 if self.ran[w] <= 2 else 16.0 + 4.8 * self.rng.random() + 2.0 * changed


def tokens_per_ms(log: list[tuple[int, int, float]]) -> float:
    return sum(n for _, n, _ in log) / sum(ms for _, _, ms in log)


def test_the_width_in_use_is_left_only_for_one_better_by_the_switch_margin():
    E = BatchPolicy(B, TABLE).acceptance.expected_tokens()            # the prior's: 1 + sum 0.6^i
    t3 = 10.0
    near = {0: 10.0, 1: 9.0, 3: t3, 5: E[5] / (E[3] / t3 * 1.02), 15: 90.0}      # w=4 and 5 promise 2 % more than w=3
    far = {**near, 5: E[5] / (E[3] / t3 * 1.06)}                                   # w=5 promises 6 % more
    p = BatchPolicy(B, CostTable({1: {**near, 5: 30.0}}), learn_costs=False)
    p.use_concurrency(1)
    assert p.width() == 3
    for table, expect in ((near, 3), (far, 5), (near, 5)):
        p.costs, p.concurrency = CostTable({1: table}), None          # as the backend hands a policy new costs
        p.use_concurrency(1)
        s = p.scores()
        assert max(range(B), key=s.__getitem__) in (4, 5) and p.width() == expect
    assert SWITCH_MARGIN == 0.03


def test_a_cost_probe_runs_its_coarse_width_until_it_settles():
    p = BatchPolicy(B, TABLE)
    widths = drive(p, flat, 120, 0)
    first = widths.index(B - 1)                                        # the table starts it narrow, then the probe
    assert len(set(widths[:first])) == 1 and first >= EXPLORE_EVERY - 1         # the probe: the EXPLORE_EVERY-th drafting round
    assert widths[first:first + WARMUP + MIN_SEEN] == [B - 1] * (WARMUP + MIN_SEEN)
    assert min(widths[first:]) >= 12                                   # found as cheap as the narrow width: kept
    assert probe_widths(16) == [1, 3, 7, 15] and probe_widths(8) == [1, 3, 7] and probe_widths(6) == [1, 3, 5]
    table = CostTable({1: {0: 13.0, 1: 18.0, 15: 18.0}})               # flat table over steep rounds: probes narrower
    probed = {w for w in drive(BatchPolicy(B, table), steep, 300, 0)[1:]} - {B - 1}
    assert probed & set(probe_widths(B)) and 7 in probed


@pytest.mark.parametrize("seed", range(4))
def test_gpu_like_rounds_under_a_table_twice_as_dear_settle_wide_and_stay(seed):
    """The H200 SmolLM2 pair: the table is about twice the real rounds, rounds cost the same at every width."""
    table = CostTable({1: {w: 2 * (16.0 + 0.3 * w) for w in (0, 1, 3, 5, 7, 11, 15)}})
    log = simulate(BatchPolicy(B, table), GpuRounds(seed), 600, seed)
    widths = [w for w, _, _ in log]
    assert widths.index(B - 1) <= EXPLORE_EVERY + 4 and set(widths[60:]) == {B - 1}     # one probe, then kept
    best = max(tokens_per_ms(simulate(BatchPolicy(B, table, fixed_width=w), GpuRounds(seed), 600, seed)[60:])
               for w in (3, 7, 11, 15))
    assert tokens_per_ms(log[60:]) >= 0.995 * best


@pytest.mark.parametrize("seed", range(4))
def test_gpu_like_rounds_under_a_steep_table_end_within_a_few_percent_of_the_best_fixed_width(seed):
    log = simulate(BatchPolicy(B, TABLE), GpuRounds(seed), 600, seed)
    widths = [w for w, _, _ in log]
    best = max(tokens_per_ms(simulate(BatchPolicy(B, TABLE, fixed_width=w), GpuRounds(seed), 600, seed)[100:])
               for w in (3, 7, 11, 15))
    assert tokens_per_ms(log[100:]) >= 0.96 * best and sum(w >= 11 for w in widths[100:]) >= 0.8 * 500
    assert sum(a != b for a, b in zip(widths[100:], widths[101:])) <= 16     # no churn: each change pays warm-up



class DearDrafting(GpuRounds):
    """GpuRounds where an AR round costs 80 % of a drafting round."""

    def __call__(self, w: int) -> float:
        return super().__call__(w) * (0.8 if w == 0 else 1.0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("accept", [0.1, 0.25])
def test_under_a_table_twice_as_dear_a_losing_drafter_times_ar_and_falls_back_to_it(seed, accept):
    """The table's AR entry (32 ms) holds every observed drafting width (~17 ms) up to it, so drafting always looks
    like a gain until an AR round is timed: a cost probe of w = 0 must time it (it was 0.88-0.91x AR without)."""
    table = CostTable({1: {w: 2 * (16.0 + 0.3 * w) for w in (0, 1, 3, 5, 7, 11, 15)}})
    policy = BatchPolicy(B, table)
    log = simulate(policy, DearDrafting(seed), 600, seed, accept)
    ar = simulate(BatchPolicy(B, table, fixed_width=0), DearDrafting(seed), 600, seed, accept)
    assert 0 in policy.learned.settled(1)
    if accept < 0.2:                              # a clear loss (0.25: about break-even at w = 1-3)
        assert sum(w == 0 for w, _, _ in log[60:]) > 0.5 * 540
    assert tokens_per_ms(log[60:]) >= 0.95 * tokens_per_ms(ar[60:])


@pytest.mark.parametrize("seed", range(3))
def test_auto_picks_only_widths_whose_shapes_the_calibration_or_a_probe_ran(seed):
    """Every other width's first rounds would run eagerly and capture a CUDA graph mid-answer (2026-12-05, H100:
    auto's first repetition at c=8 ran 0.25x B=16 while it tried 12 widths at each job count)."""
    for table, menu in ((TABLE, {0, 1, 3, 5, 7, 11, 15}), (CostTable({1: {0: 13.0, 4: 15.0, 12: 20.0}}), {0, 1, 3, 4, 7, 12, 15})):
        p = BatchPolicy(B, table)
        assert set(drive(p, GpuRounds(seed), 400, seed)) <= menu and p.menu == sorted(menu)

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
    report = cost_report(be.policies[(True, ADOPTED.tag)])
    assert report["start"][1] == pytest.approx({w: 10.0 + 3.0 * w for w in range(8)})
    if learn:
        assert tail.count(7) >= 0.9 * len(tail)                      # 14 ms at any width: the widest wins
        assert report["learned"][1][7] == pytest.approx(14.0)
        seen = report["observed"][1].values()                        # every round but the prefill one: kept or warm-up
        assert sum(o["rounds"] + o["warmup"] for o in seen) == len(rounds) - 1 and sum(o["warmup"] for o in seen) >= 2
    else:
        assert max(tail) <= 3 and report["learned"] == report["start"] and "observed" not in report
    fixed = list(be.generate([p], GenSettings(max_new_tokens=40, block_size=5)))
    assert {len(r.drafted) for r in fixed} == {4} and cost_report(be.policies[(True, ADOPTED.tag)]) == report


# -- calibration: replayed rounds, not captures ---------------------------------------------------------------------

def capturing_cost(steady):
    """Round cost of the stand-in Generator whose first two rounds of each (width, jobs) shape are slow (eager, then
    CUDA graph capture) and whose third is too (a new shape's first replay), as exllamav3's per-slot graphs."""
    ran = Counter()

    def cost(w: int, rows: int) -> float:
        ran[w, rows] += 1
        return steady(w, rows) + (60.0 if ran[w, rows] <= 3 else 0.0)
    return cost


def test_calibration_warms_every_width_up_and_times_only_replayed_rounds(monkeypatch, tmp_path):
    from toolkit.exl3 import calibrate as exl3_calibrate
    from toolkit.exl3.calibrate import TABLE_VERSION

    clock, raw = Clock(), []
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(capturing_cost(lambda w, rows: 16.0 + 0.1 * w * rows)))
    timer = exl3_calibrate.time_rounds
    monkeypatch.setattr(exl3_calibrate, "time_rounds", lambda *a, **k: raw.append(timer(*a, **k)) or raw[-1])
    be = make_backend(monkeypatch, tmp_path)
    be.clock = clock
    table = be.cost_table(2)
    steady = {w: 16.0 + 0.2 * w for w in (0, 1, 3, 5, 7)}
    assert table.ms[2] == pytest.approx(steady)
    assert all(t == pytest.approx(steady[w]) for w, ts in raw[0].items() for t in ts)     # not one slow round timed
    assert [p.name.endswith(f"-v{TABLE_VERSION}.json") for p in (tmp_path / "costs").glob("*.json")] == [True]
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(capturing_cost(lambda w, rows: 16.0 + 0.1 * w * rows)))
    again = make_backend(monkeypatch, tmp_path)
    assert again.cost_table(2).ms[2] == pytest.approx(steady) and len(raw) == 1        # read back from the cache


def test_the_decoding_like_calibration_times_text_prompts_in_stretches_without_syncing(monkeypatch, tmp_path):
    """DECODE_LIKE: each job prefills the built-in text from another prompt on, every width runs `stretch` rounds
    in a row of which the first `settle` are not timed, and no device synchronize brackets a round."""
    from toolkit.exl3 import calibrate as exl3_calibrate
    from toolkit.exl3.calibrate import DECODE_LIKE as CALIBRATION, calibration_widths, text_prompts, time_calibration

    clock = Clock()
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(capturing_cost(lambda w, rows: 16.0 + 0.1 * w * rows)))
    be = make_backend(monkeypatch, tmp_path)
    be.clock = clock
    be.raw_encode = lambda text: [3 + ord(ch) % 90 for ch in text]
    syncs = []
    be.sync = lambda: syncs.append(1)
    prompts = text_prompts(be, 3)
    assert len({tuple(p) for p in prompts}) == 3 and all(len(p) > exl3_calibrate.CALIBRATION_CONTEXT for p in prompts)
    ws = calibration_widths(be.block_size)
    times = time_calibration(be, 2, ws, CALIBRATION)
    per_width = CALIBRATION.reps * (CALIBRATION.stretch - CALIBRATION.settle)
    assert CALIBRATION.text and not CALIBRATION.sync and not syncs
    assert {w: len(ts) for w, ts in times.items()} == {w: per_width for w in ws}
    assert all(t == pytest.approx(16.0 + 0.2 * w) for w, ts in times.items() for t in ts)   # no slow round timed
