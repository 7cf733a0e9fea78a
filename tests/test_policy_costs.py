"""The policy on a CPU: costs corrected by observed rounds, probe spacing, tap hooks instead of
output_hidden_states, a long AR stretch then probes (lossless), and the one-sentence AR verdict."""

import html
import math

import pytest
import torch

from policy_fakes import Scripted
from toolkit.dflash import gather_taps
from toolkit.runtime.events import Round, ar_verdict, tokens_of
from toolkit.runtime.loop import decode
from toolkit.policy.chooser import CARRY, MIN_GAP, PROBE_BUDGET, Policy
from toolkit.costs.table import CostTable
from toolkit.costs.book import KEEP, MIN_SEEN
from toolkit.runtime.sampling import Sampler

B = 16


def linear(t0: float, base: float, per: float) -> CostTable:
    return CostTable({1: {0: t0, **{w: base + per * w for w in range(1, B)}}})


def feed(p: Policy, width: int, ms: float, accepted: int = 0, n: int = 1) -> None:
    """n rounds of `width` verified drafts, each taking `ms`, `accepted` of them accepted."""
    for _ in range(n):
        p.width(1)
        drafted = tuple(range(1, width + 1))
        rnd = Round(drafted, min(accepted, width), 0, 0.0, ms, proposed=B - 1 if width else 0)
        p.observe([(0, tuple(range(1, B)) if width else (), rnd)], ms)


def started(*a, **kw) -> Policy:
    p = Policy.auto(*a, **kw)
    p.start(0, 0)
    return p


# -- costs learnt from the rounds ---------------------------------------------------------------------------------

CALIBRATED = (0, 1, 3, 5, 7, 11, 15)            # the widths exllamav3's calibration times


def timed(table: CostTable, scale: float = 1.0) -> CostTable:
    """`table` at the calibration's widths, drafting widths x `scale`."""
    return CostTable({1: {w: t * (scale if w else 1.0) for w, t in table.ms[1].items() if w in CALIBRATED}})


def test_observed_rounds_correct_a_table_that_makes_drafting_look_cheap():
    true = linear(10, 45, 0.37)                                   # drafting really costs 4.5-5 AR steps
    p = started(B, timed(true, 12 / 45), learn_costs=True)        # tabled: 1.2-1.3 AR steps
    for _ in range(20):
        p.learn(2, p.fade(1))                                     # 2 of every proposal accepted
    assert p.width() > 0
    drafted = 0
    for _ in range(80):
        w = p.width()
        drafted += w > 0
        feed(p, w, true.ms[1][w], accepted=2)
    assert p.best() == 0 and drafted <= 45                        # each width ruled out by its own rounds
    assert p.costs.curve(1)[15] == pytest.approx(true.ms[1][15])


def test_a_poisoned_table_is_corrected_within_a_few_rounds():
    """Every drafting cost in the table x 0.2 (timed under other load): the rounds the policy drafts show it."""
    true = linear(10, 20, 1)
    p = started(B, timed(true, 0.2), learn_costs=True)
    for _ in range(20):
        p.learn(1, p.fade(1))
    assert p.width() > 0
    drafted = 0
    for _ in range(60):
        w = p.width()
        drafted += w > 0
        feed(p, w, true.ms[1][w], accepted=1)
    assert p.best() == 0 and drafted <= 40


def test_observed_rounds_correct_a_table_timed_on_a_busy_machine():
    p = started(B, linear(10, 60, 1), learn_costs=True)          # tabled: drafting 6-7.5 AR steps (noise)
    feed(p, 0, 10.0, n=10)
    feed(p, 15, 15.0, accepted=15, n=MIN_SEEN)                    # really 1.5 steps, and everything is accepted
    assert p.costs.curve(1)[15] == pytest.approx(15.0) and p.best() > 0


def test_a_given_table_is_taken_as_is_and_slow_rounds_move_a_learnt_one_little():
    p = started(B, linear(10, 12, 0.1))
    feed(p, 0, 10.0, n=5)
    feed(p, 15, 500.0, n=MIN_SEEN)
    assert p.costs.curve(1) == linear(10, 12, 0.1).nearest(1)
    q = started(B, linear(10, 12, 0.1), learn_costs=True)
    feed(q, 0, 10.0, n=15)
    feed(q, 0, 1000.0, n=3)                                       # three AR rounds 100x slow (another process)
    assert q.costs.curve(1)[0] == pytest.approx(10.0)             # the median of the recent rounds
    feed(q, 7, 30.0, n=MIN_SEEN - 1)
    assert q.costs.curve(1)[7] == pytest.approx(12.7)             # the table's until a width was seen MIN_SEEN times


def test_a_poisoned_table_and_a_probe_under_a_load_burst_recover():
    """The table timed under load (the AR step 770 ms, the 1-draft round dearer than the 15-draft one: it contradicts
    itself), live AR rounds at 130 ms, and the first probe slowed by a burst (3306 ms): the live AR rounds scale the
    table to the machine's load, the slow probe is one round of the MIN_SEEN a cost needs, and drafting resumes
    with every cost in use a median of several rounds."""
    poisoned = CostTable({1: {0: 770.0, 1: 4032.0, 2: 2700.0, 3: 2750.0, 4: 2760.0, 8: 2790.0, 15: 2825.0}},
                         counts={1: {w: 5 for w in (0, 1, 2, 3, 4, 8, 15)}})
    assert "the 1-draft round took 4.03e+03 ms, more than the 2-draft round" in poisoned.contradiction()
    true = {0: 130.0, 1: 180.0, 2: 190.0, 3: 200.0, 4: 210.0, 8: 250.0, 15: 330.0}   # drafting 1.4-2.5 AR steps

    def run(p: Policy) -> list[int]:
        widths: list[int] = []
        for _ in range(300):
            widths.append(p.width())                              # the drafter is right 3 positions out of 15
            feed(p, widths[-1], 3306.0 if widths[-1] and not any(widths[:-1]) else true[widths[-1]], accepted=3)
        return widths

    p = started(B, poisoned, learn_costs=True)
    widths = run(p)
    probes = [i for i, w in enumerate(widths) if w]
    assert probes[0] == 0 and p.costs.scale[1] == pytest.approx(130 / 770)          # the burst probe, then scaled
    assert all(widths[-100:])                                     # drafting again, every round of the last 100
    book = {c.width: c for c in p.costs.book(1)}
    assert book[0].source == "live" and book[0].rounds == KEEP and book[0].ms == pytest.approx(130.0)
    assert book[15].source == "live" and book[15].ms == pytest.approx(330.0)        # the burst: 1 round of many
    assert book[2].source == "scaled" and book[2].rounds == 5 and book[2].ms == pytest.approx(2700 * 130 / 770)
    assert "its AR step took 770 ms, the live AR rounds 130 ms: scaled to them" in p.costs.table.source

    unscaled = started(B, poisoned, learn_costs=True)             # the table as timed beside live AR rounds:
    unscaled.costs.rescale = lambda jobs, got: False                   # the burst probe is the last one
    assert [i for i, w in enumerate(run(unscaled)) if w] == [0]


def test_a_table_that_contradicts_itself_is_timed_again_and_a_disagreeing_one_leaves_the_cache(tmp_path):
    from toolkit.costs.cache import TRIES, cached_costs

    timings = iter([{0: 10.0, 1: 50.0, 15: 30.0}] * TRIES + [{0: 10.0, 1: 12.0, 15: 30.0}])
    calls = []

    def measure():
        calls.append(1)
        return CostTable({1: next(timings)}, counts={1: {0: 5, 1: 5, 15: 5}})

    odd = cached_costs("k", measure, tmp_path)
    assert len(calls) == TRIES and not (tmp_path / "k.json").exists()          # out of order every time: not kept
    assert odd.source.startswith("timed now, not cached: the 1-draft round took 50 ms, more than the 15-draft")
    good = cached_costs("k", measure, tmp_path)
    assert (tmp_path / "k.json").is_file() and good.source == "timed now" and good.timed_at is not None
    again = cached_costs("k", measure, tmp_path)
    assert again.source.startswith("cached") and again.counts == {1: {0: 5, 1: 5, 15: 5}}
    p = started(B, again, learn_costs=True)
    feed(p, 0, 40.0, n=MIN_SEEN)                                  # the moment's load (4x): the table holds
    assert (tmp_path / "k.json").exists() and p.costs.scale.get(1, 1.0) == 1.0
    feed(p, 0, 2.5, n=KEEP)                                       # 4x cheaper: it was timed under heavier load
    assert not (tmp_path / "k.json").exists() and p.costs.scale[1] == pytest.approx(0.25)


def test_probe_spacing_is_net_of_expected_tokens_and_follows_learnt_costs():
    p = started(B, linear(10, 40, 1), learn_costs=True)
    expected = p.expected_tokens()[-1]
    assert p.gap(1) == max(MIN_GAP, math.ceil((55 / 10 - expected) / PROBE_BUDGET))
    before = p.gap(1)
    feed(p, 0, 10.0, n=10)
    feed(p, 15, 110.0, n=MIN_SEEN)                                # drafting rounds cost twice the table
    assert p.gap(1) > 1.5 * before                                # so probes come less often


def test_no_probe_comes_early_in_an_answer():
    p = Policy.auto(B, linear(10, 40, 1))
    g = p.gap(1)
    assert g == math.ceil((5.5 - 1) / PROBE_BUDGET) == 150        # nothing seen yet: 1 token a round
    first = list(decode(Scripted(lambda n: 0), [1, 2], 60, Sampler(), set(), policy=p))[1:]
    assert [i for i, r in enumerate(first) if r.drafted] == [0]           # a fresh policy learns from one proposal
    for _ in range(5):                                            # 360 AR rounds in all: the gap is long past
        rounds = list(decode(Scripted(lambda n: 0), [1, 2], 60, Sampler(), set(), policy=p))
        assert not any(r.drafted for r in rounds)                 # but each answer is shorter than g rounds
    rounds = list(decode(Scripted(lambda n: 0), [1, 2], 400, Sampler(), set(), policy=p))[1:]
    at = [i for i, r in enumerate(rounds) if r.drafted]
    assert at[0] == g and all(b - a > g - 2 for a, b in zip(at, at[1:]))   # at 3 % of this answer, then no closer


def test_a_new_answer_starts_from_the_long_run_rates_and_unlearns_within_a_few_rounds():
    p = Policy.auto(B, linear(10, 20, 0.5))                      # a full round costs 2.75 AR steps
    for _ in range(3):                                            # answers where the drafter is always right
        list(decode(Scripted(lambda n: B), [1], 200, Sampler(), set(), policy=p))
    assert p.rates[-1] > 0.9
    p.start(0, 0)
    assert p.weight == CARRY and p.rates[-1] > 0.9                # a new answer: the long-run rates, weighing CARRY
    p.finish(0)
    rounds = list(decode(Scripted(lambda n: 0), [1], 60, Sampler(), set(), policy=p))[1:]   # now always wrong
    assert sum(1 for r in rounds[:30] if r.drafted) <= 14         # the estimate falls from ~1 to ~0.12 in ~12 rounds


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5_moe"])
def test_tap_hooks_capture_what_output_hidden_states_gives(models, arch):
    from toolkit.dflash import load_drafter
    from toolkit.runtime.hf import load_hf_model
    from toolkit.runtime.torch_backend import TapHooks, TorchSteps

    target_dir, draft_dir = models[arch]
    target, drafter = load_hf_model(target_dir), load_drafter(draft_dir)
    n = target.config.get_text_config().num_hidden_layers
    steps = TorchSteps(target, drafter)
    assert steps.hooks is not None and steps.hidden is False
    assert TapHooks.of(target, steps.taps) is steps.hooks                   # installed once per target
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    for idx in ([1], [n], [1, n], sorted({1, (n + 1) // 2, n}, reverse=True)):
        hooks = TapHooks.of(target, idx)
        with torch.no_grad():
            out, got = hooks.forward(lambda: target(input_ids=ids, output_hidden_states=True), idx)
        for i, g in zip(idx, got):
            torch.testing.assert_close(g, out.hidden_states[i], rtol=0, atol=0)
        assert getattr(hooks.local, "sink", None) is None                   # idle outside a capture
    with torch.no_grad():
        out = target(input_ids=torch.tensor([[3, 5, 7]]), output_hidden_states=True)
        _, taps = steps._forward([3, 5, 7], capture=True)
    torch.testing.assert_close(torch.cat(taps, -1), gather_taps(out.hidden_states, drafter.config), rtol=0, atol=0)


def test_tap_hooks_refuse_an_embedding_tap_and_an_unusual_layout(pair_backend):
    from toolkit.runtime.torch_backend import TapHooks

    assert TapHooks.of(pair_backend.target, [0]) is None
    assert TapHooks.of(pair_backend.target, [99]) is None
    assert TapHooks.of(torch.nn.Linear(2, 2), [1]) is None


def test_a_long_ar_stretch_then_probes_is_lossless_and_gives_the_eager_context(pair_backend, monkeypatch):
    from toolkit.runtime import torch_backend as tb

    class Script(Policy):
        def __init__(self, widths):
            super().__init__(B, linear(10, 20, 1))
            self.widths, self.k = widths, 0

        def width(self, jobs: int = 1) -> int:
            self.k += 1
            return self.widths[min(self.k - 1, len(self.widths) - 1)]

    ids = pair_backend.tokenizer.encode("Write a function")
    widths = [0] * 300 + [15, 0, 0, 3, 15, 15]                    # > BACKLOG_MAX AR tokens, then probes
    n = len(widths) + 40
    ar = list(decode(tb.TorchSteps(pair_backend.target, None), ids, n, Sampler(), set(), 0))
    lazy = tb.TorchSteps(pair_backend.target, pair_backend.drafter)
    extends = []
    extend = pair_backend.drafter.extend
    monkeypatch.setattr(pair_backend.drafter, "extend", lambda c, taps: (extends.append(taps.shape[1]), extend(c, taps)))
    got = list(decode(lazy, ids, n, Sampler(), set(), policy=Script(widths)))
    assert tokens_of(got) == tokens_of(ar)
    assert [len(r.drafted) for r in got[1:len(widths) + 1]] == widths
    assert extends[0] == tb.BACKLOG_MAX and sum(extends[:2]) == len(ids) + 300   # one flush at the cap, one at the probe
    monkeypatch.setattr(tb, "BACKLOG_MAX", 1)
    eager = tb.TorchSteps(pair_backend.target, pair_backend.drafter)
    eager.hooks, eager.hidden = None, True                        # transformers' output_hidden_states, every round
    want = list(decode(eager, ids, n, Sampler(), set(), policy=Script(widths)))
    assert [(r.drafted, r.accepted, r.bonus) for r in got] == [(r.drafted, r.accepted, r.bonus) for r in want]
    lazy.flush()
    for a, b in zip(lazy.draft_cache.k + lazy.draft_cache.v, eager.draft_cache.k + eager.draft_cache.v):
        torch.testing.assert_close(a, b)


# -- the policy says so -------------------------------------------------------------------------------------------

def test_ar_verdict_is_one_sentence_only_when_almost_all_rounds_are_ar():
    assert ar_verdict(0, 0) == "" and ar_verdict(8, 2) == "" and ar_verdict(0, 12) == ""
    one = ar_verdict(122, 1)
    assert one.startswith("Drafting does not pay here: the policy decoded 122 of 123 rounds as plain AR (1 probe)")
    assert one.count(".") == 1 and one.endswith(".")
    assert "(3 probes)" in ar_verdict(60, 3) and "probe" not in ar_verdict(40, 0)


def test_the_app_stat_line_states_the_verdict():
    from toolkit.app import render
    from toolkit.runtime.events import summarize

    probe = Round((1, 2, 3), 1, 9, proposed=15)
    mostly_ar = render.tau_html(summarize([probe]), 16, ar_rounds=40)
    assert "40 plain AR rounds (block 1). Drafting does not pay here" in html.unescape(mostly_ar)
    mixed = render.tau_html(summarize([probe] * 10), 16, ar_rounds=5)
    assert "Drafting does not pay" not in html.unescape(mixed)
    assert "Drafting does not pay" not in render.tau_html(None, 16)


def test_flat_verify_costs_make_the_policy_verify_wide():
    """What a verify path at memory speed gives the policy: rounds that cost about the same at every width, so it
    verifies as wide as acceptance pays (here the whole block), with no setting to change."""
    flat = CostTable({1: {0: 6.0, 1: 10.0, 3: 10.2, 5: 10.3, 7: 10.4, 11: 10.6, 15: 10.8}})
    steep = CostTable({1: {0: 6.0, 1: 9.9, 3: 11.6, 5: 13.5, 7: 15.3, 11: 28.2, 15: 31.2}})   # exllamav3 today
    widths = {}
    for name, table in (("flat", flat), ("steep", steep)):
        p = started(B, table)
        for _ in range(300):
            p.learn(12, p.fade(1))                        # 12 of 15 drafts accepted, as a good drafter does
        widths[name] = p.width()
    assert widths == {"flat": 15, "steep": 7}
