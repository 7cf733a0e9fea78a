"""The drafting policy on the tiny pair: lossless with scripted and auto widths, and as the torch backend's default
(its cost table timed once, cached and reported; AR rounds that leave the drafter alone or defer its context)."""

import math

import pytest
import torch

from policy_fakes import B, Forced, linear
from toolkit.costs.cache import COST_CACHE_ENV, cost_key
from toolkit.costs.table import CostTable
from toolkit.policy.chooser import Policy
from toolkit.runtime.events import tokens_of
from toolkit.runtime.loop import decode
from toolkit.runtime.sampling import Sampler
from toolkit.runtime.torch_backend import measure_torch_costs


# -- lossless with variable widths on the tiny pair --------------------------------------------------------------

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


# -- the policy as the torch backend's default -------------------------------------------------------------------

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


def test_backend_measures_costs_once_caches_them_and_keeps_its_policies(pair, pair_backend, tmp_path, monkeypatch,
                                                                       steady_costs):
    from toolkit.runtime.backend import GenSettings
    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path))
    be = fresh_backend(pair_backend, pair)
    ids = be.tokenizer.encode("Open the file")
    list(be.generate(ids, GenSettings(max_new_tokens=8)))
    key = cost_key(pair, be.target.device, be.target.dtype, B)
    assert (tmp_path / f"{key}.json").is_file() and sorted(be.book.table().ms[1]) == [0, 1, 2, 3, 4, 8, 15]
    greedy = be.book.live(True)
    n = greedy.count
    list(be.generate(ids, GenSettings(max_new_tokens=24)))
    assert be.policy(True) is greedy and greedy.count >= n
    list(be.generate(ids, GenSettings(max_new_tokens=8, temperature=0.8, seed=1)))
    assert set(be.book.policies) == {(True, ""), (False, "")} and be.book.live(False) is not greedy
    assert greedy.costs.learn                                 # a timed table is corrected by the rounds

    other = fresh_backend(pair_backend, pair)              # a second backend reads the cache instead of timing:
    checked = []                                           # it times only AR and the widest width, as they were

    def check_only(*a, widths=None, **k):
        assert tuple(widths) == (0, B - 1), "re-measured"
        checked.append(widths)
        return CostTable({1: {w: be.book.table().ms[1][w] for w in widths}})

    monkeypatch.setattr("toolkit.runtime.torch_backend.measure_torch_costs", check_only)
    assert other.book.table() == be.book.table() and len(checked) == 1


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
    assert len(rounds) == len(tokens_of(rounds)) and seen and not any(seen) and not be.book.policies


def test_the_cost_source_is_reported_and_retiming_skips_the_cache(pair, pair_backend, tmp_path, monkeypatch,
                                                                  steady_costs):
    import toolkit.costs.cache as cost_cache
    from toolkit.runtime.backend import GenSettings

    monkeypatch.setenv(COST_CACHE_ENV, str(tmp_path))
    # a busy machine's AR step can read 3x the cached one and retime the table: that check is test_policy.py's
    monkeypatch.setattr(cost_cache, "stale", lambda table, now: "")
    ids = pair_backend.tokenizer.encode("Open the file")
    first = fresh_backend(pair_backend, pair)
    assert first.cost_source() is None
    list(first.generate(ids, GenSettings(max_new_tokens=4)))
    assert first.cost_source() == "timed now"
    cached = fresh_backend(pair_backend, pair)
    list(cached.generate(ids, GenSettings(max_new_tokens=4)))
    assert cached.cost_source().startswith("cached ") and str(tmp_path) in cached.cost_source()
    again = fresh_backend(pair_backend, pair)
    again.book.retime = True
    list(again.generate(ids, GenSettings(max_new_tokens=4)))
    assert again.cost_source() == "timed now"

