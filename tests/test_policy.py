"""The drafting policy: width arithmetic, hindsight acceptance, probing, the cost cache, losslessness."""

import json
import math

import pytest
import torch

from toolkit.runtime.events import Round, summarize, tokens_of
from toolkit.runtime.loop import decode
from toolkit.policy.chooser import MIN_GAP, PROBE_BUDGET, Policy
from toolkit.costs.cache import COST_CACHE_ENV, cached_costs, cost_dir, cost_key
from toolkit.costs.table import CostTable, interpolate
from toolkit.runtime.torch_backend import measure_torch_costs
from toolkit.runtime.sampling import Sampler

B = 16
V = 50


def truth(i: int) -> int:
    """The scripted target's greedy token at output position i."""
    return (7 * i + 3) % V


def linear(t0: float, base: float, per: float, block: int = B) -> CostTable:
    """AR costs t0; a round verifying w >= 1 drafts costs base + per * w."""
    return CostTable({1: {0: t0, **{w: base + per * w for w in range(1, block)}}})


class Scripted:
    """Target: one-hot on truth(). Drafter: right for the first good(n) ids of a block, n = tokens kept so far."""

    def __init__(self, good):
        self.good, self.n = good, 0

    def onehot(self, ids):
        x = torch.full((len(ids), V), -1e9)
        x[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
        return x

    def prefill(self, prompt):
        self.n = 0
        return self.onehot([truth(0)])[-1]

    def draft_block(self, token, width):
        g = self.good(self.n)
        return [truth(self.n + 1 + i) if i < g else (truth(self.n + 1 + i) + 1) % V for i in range(width)]

    def verify(self, block):
        return self.onehot([truth(self.n + 1 + i) for i in range(len(block))])

    def accept(self, n):
        self.n += n


class Forced(Policy):
    """An auto-mode policy (drafts all B-1) whose widths follow a script, cycling."""

    def __init__(self, widths, block=B):
        super().__init__(block, linear(10, 20, 1, block))
        self.script, self.k = widths, 0

    def width(self, jobs: int = 1) -> int:
        self.k += 1
        return self.script[(self.k - 1) % len(self.script)]


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


def test_expensive_drafter_falls_back_to_ar_from_the_prior():
    p = Policy.auto(B, linear(10, 100, 1))
    p.start(0, 0)
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
    assert gaps[0] == MIN_GAP                                # a fresh policy learns from a proposal at once ...
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


# -- (d) cost cache ----------------------------------------------------------------------------------------------

def test_cost_cache_round_trip_and_corrupt_file(tmp_path, monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return CostTable({1: {0: 1.5, 3: 4.0}}, device="test")

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


def test_cost_key_follows_configs_device_dtype_and_block(pair):
    t, d = pair
    k = cost_key([t, d], "cpu", torch.float32, 16)
    assert k == cost_key([t, d], "cpu", torch.float32, 16)
    assert len({k, cost_key([t], "cpu", torch.float32, 16), cost_key([t, d], "cpu", torch.bfloat16, 16),
                cost_key([t, d], "cpu", torch.float32, 8)}) == 4


# -- (e) lossless with variable widths on the tiny pair ----------------------------------------------------------

PROMPTS = ["Return the list of", "Open the file", "Write a function", "hi"]


def pair_decode(backend, prompt, policy, draft_width=0, n=48):
    from toolkit.runtime.torch_backend import TorchSteps

    ids = backend.tokenizer.encode(prompt)
    drafter = backend.drafter if (policy is not None or draft_width) else None
    return list(decode(TorchSteps(backend.target, drafter), ids, n, Sampler(), set(backend.eos_ids), draft_width, policy))


def test_variable_widths_are_lossless_on_the_tiny_pair(pair_backend):
    widths = [0, 3, 15, 1, 7, 0, 0, 15, 2, 11]
    for prompt in PROMPTS:
        ar = pair_decode(pair_backend, prompt, None)
        p = Forced(widths)
        spec = pair_decode(pair_backend, prompt, p)
        assert tokens_of(spec) == tokens_of(ar), prompt
        assert [len(r.drafted) for r in spec[1:]] == [widths[i % len(widths)] for i in range(len(spec) - 1)]
        assert all(r.proposed == (B - 1 if r.drafted else 0) for r in spec[1:])
        assert p.count > 0


def test_auto_policy_is_lossless_on_the_tiny_pair(pair_backend):
    costs = measure_torch_costs(pair_backend.target, pair_backend.drafter, reps=2, widths=[1, 4, 15])
    assert sorted(costs.ms[1]) == [0, 1, 4, 15] and all(v > 0 for v in costs.ms[1].values())
    for table in (costs, linear(10, 10.5, 0.1), linear(10, 30, 0.5)):
        p = Policy.auto(B, table)
        for prompt in PROMPTS:
            spec = pair_decode(pair_backend, prompt, p)
            assert tokens_of(spec) == tokens_of(pair_decode(pair_backend, prompt, None)), prompt
            assert all(0 <= len(r.drafted) <= B - 1 for r in spec)


# -- (f) the policy as the torch backend's default ---------------------------------------------------------------

def fresh_backend(pair_backend, pair, costs=None):
    """A TorchBackend over the shared tiny models with its own policies (and cost table unless given)."""
    from toolkit.runtime.torch_backend import TorchBackend

    return TorchBackend(pair_backend.target, pair_backend.tokenizer, pair_backend.drafter, costs=costs, folders=pair)


def test_gen_settings_block_size_is_auto_or_a_fixed_block():
    from toolkit.runtime.backend import GenSettings

    s = GenSettings()
    assert s.block_size == "auto" and s.auto and s.fixed_block(16) == 16
    assert GenSettings(block_size="AUTO").auto and GenSettings(block_size="8").block_size == 8
    assert GenSettings(block_size=32).fixed_block(16) == 16 and GenSettings(block_size=None).fixed_block(8) == 8
    assert not GenSettings(block_size=4).auto and GenSettings(block_size=4).fixed_block(16) == 4
    for bad, msg in ((1, ">= 2"), ("1", ">= 2"), ("x", "auto or an integer"), (2.5, "auto or an integer"), (True, "auto or")):
        with pytest.raises(ValueError, match=msg):
            GenSettings(block_size=bad)


def test_backend_measures_costs_once_caches_them_and_keeps_its_policies(pair, pair_backend, tmp_path, monkeypatch):
    from toolkit.runtime.backend import GenSettings
    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path))
    be = fresh_backend(pair_backend, pair)
    ids = be.tokenizer.encode("Open the file")
    list(be.generate(ids, GenSettings(max_new_tokens=8)))
    key = cost_key(pair, be.target.device, be.target.dtype, B)
    assert (tmp_path / f"{key}.json").is_file() and sorted(be.costs.ms[1]) == [0, 1, 2, 3, 4, 8, 15]
    greedy = be.policies[True]
    n = greedy.count
    list(be.generate(ids, GenSettings(max_new_tokens=24)))
    assert be.policy(True) is greedy and greedy.count >= n
    list(be.generate(ids, GenSettings(max_new_tokens=8, temperature=0.8, seed=1)))
    assert set(be.policies) == {True, False} and be.policies[False] is not greedy
    assert greedy.costs.learn                                 # a timed table is corrected by the rounds

    other = fresh_backend(pair_backend, pair)              # a second backend reads the cache instead of timing
    monkeypatch.setattr("toolkit.runtime.torch_backend.measure_torch_costs", lambda *a, **k: pytest.fail("re-measured"))
    assert other.cost_table() == be.costs


def test_auto_through_generate_is_lossless_with_variable_widths(pair, pair_backend, tmp_path, monkeypatch):
    from toolkit.runtime.backend import GenSettings

    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path))
    for costs in (None, linear(10, 10.5, 0.3), CostTable({1: {0: 10, 1: 13, 4: 14, 8: 22, 15: 40}})):
        be = fresh_backend(pair_backend, pair, costs)
        widths = set()
        for prompt in PROMPTS:
            ids = be.tokenizer.encode(prompt)
            spec = list(be.generate(ids, GenSettings(max_new_tokens=48)))
            ar = list(be.generate(ids, GenSettings(max_new_tokens=48), speculative=False))
            assert tokens_of(spec) == tokens_of(ar), (prompt, costs)
            assert all(r.proposed == (B - 1 if r.drafted else 0) for r in spec[1:])
            assert all(not r.drafted and r.proposed == 0 for r in ar)
            widths |= {len(r.drafted) for r in spec[1:]}
        if costs is not None and 15 in costs.ms[1] and costs.ms[1][15] < 20:
            assert len(widths) >= 2, widths                          # a cheap table makes the width vary


def test_a_losing_cost_table_gives_ar_rounds_except_probes(pair, pair_backend):
    from toolkit.runtime.backend import GenSettings

    costs = linear(10, 20, 11)                  # t(w) > (1 + w) t(0): no acceptance can make drafting pay
    be = fresh_backend(pair_backend, pair, costs)
    first_gap = be.policy(True).gap(1)
    assert not be.policy(True).costs.learn      # a given table is taken as is
    assert first_gap == math.ceil((185 - 10) / 10 / 0.03) > 500   # a probe waits until it is 3 % of the AR rounds
    rounds = list(be.generate(be.tokenizer.encode("Return the list of"), GenSettings(max_new_tokens=first_gap + 40, stop_ids=())))[1:]
    probes_at = [i for i, r in enumerate(rounds) if r.drafted]
    assert probes_at == [first_gap] and len(rounds) > first_gap + 1
    assert all(len(rounds[i].drafted) == B - 1 and rounds[i].proposed == B - 1 for i in probes_at)
    assert all(r.drafted == () and r.proposed == 0 for i, r in enumerate(rounds) if i not in probes_at)


def test_ar_rounds_defer_the_drafter_context_and_match_the_eager_capture(pair_backend, monkeypatch):
    from toolkit.runtime import torch_backend as tb

    ids = pair_backend.tokenizer.encode("Return the list of")
    widths = [0, 0, 0, 5, 0, 15, 0, 0, 0, 0, 2, 15]
    lazy = tb.TorchSteps(pair_backend.target, pair_backend.drafter)
    calls = []
    extend = pair_backend.drafter.extend
    monkeypatch.setattr(pair_backend.drafter, "extend", lambda cache, taps: (calls.append(taps.shape[1]), extend(cache, taps)))
    got = list(decode(lazy, ids, 60, Sampler(), set(), policy=Forced(widths)))
    assert calls[0] == len(ids) + 3                 # prefill + 3 AR rounds join the drafter's context in one call
    assert len(calls) == sum(1 for r in got[1:] if r.drafted)

    monkeypatch.setattr(tb, "BACKLOG_MAX", 1)       # the old way: every round extends at once, all hidden states
    eager = tb.TorchSteps(pair_backend.target, pair_backend.drafter)
    assert eager.hooks is not None and eager.hidden is False
    eager.hooks, eager.hidden = None, True
    want = list(decode(eager, ids, 60, Sampler(), set(), policy=Forced(widths)))
    assert [(r.drafted, r.accepted, r.bonus) for r in got] == [(r.drafted, r.accepted, r.bonus) for r in want]
    lazy.flush()
    for a, b in zip(lazy.draft_cache.k + lazy.draft_cache.v, eager.draft_cache.k + eager.draft_cache.v):
        torch.testing.assert_close(a, b)


def test_the_ar_baseline_never_touches_the_drafter(pair, pair_backend, monkeypatch):
    from toolkit.runtime.backend import GenSettings

    be = fresh_backend(pair_backend, pair, linear(10, 10.5, 0.1))
    seen = []
    forward = be.target.forward
    monkeypatch.setattr(be.target, "forward", lambda *a, **k: (seen.append(k.get("output_hidden_states")), forward(*a, **k))[1])
    for name in ("extend", "draft_hidden"):
        monkeypatch.setattr(be.drafter, name, lambda *a, **k: pytest.fail("the AR baseline ran the drafter"))
    rounds = list(be.generate(be.tokenizer.encode("Open the file"), GenSettings(max_new_tokens=24), speculative=False))
    assert len(rounds) == len(tokens_of(rounds)) and seen and not any(seen) and not be.policies


def test_the_cost_source_is_reported_and_retiming_skips_the_cache(pair, pair_backend, tmp_path, monkeypatch):
    from toolkit.runtime.backend import GenSettings

    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path))
    ids = pair_backend.tokenizer.encode("Open the file")
    first = fresh_backend(pair_backend, pair)
    assert first.cost_source() is None
    list(first.generate(ids, GenSettings(max_new_tokens=4)))
    assert first.cost_source() == "timed now"
    cached = fresh_backend(pair_backend, pair)
    list(cached.generate(ids, GenSettings(max_new_tokens=4)))
    assert cached.cost_source().startswith("cached ") and str(tmp_path) in cached.cost_source()
    again = fresh_backend(pair_backend, pair)
    again.retime_costs = True
    list(again.generate(ids, GenSettings(max_new_tokens=4)))
    assert again.cost_source() == "timed now"


def test_a_fresh_policy_drafts_within_its_first_rounds():
    p = Policy.auto(B, linear(10, 14, 0.2))        # drafting pays once the drafter is known to be right
    rounds = run(p, lambda n: B, 60)[1:]
    first = next(i for i, r in enumerate(rounds) if r.drafted)
    assert first == MIN_GAP and all(r.drafted for r in rounds[first + 1:first + 10])
