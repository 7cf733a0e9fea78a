"""The drafting policy against its simplest rivals and without each of its mechanisms, replayed on the CPU over
committed device traces (tests/replay.py, tests/replay_table.py; `python -m experiments.policy_replay table`
prints the same table). The table is cached by the hash of what it depends on (tests/replay_cache.py): unchanged
inputs read it, changed ones replay it again and must give the same table.

Targets on every trace, the noisy one included: `auto` >= 0.97 of the best fixed width and >= exllamav3's own
window at c = 1, 4 and 8; >= 0.98 of AR with a drafter that accepts nothing. Each mechanism, switched off, costs
`auto` >= 1 % in some cell and pays on balance, or holds a target (its losses, where it has any, are on the
results page).
"""

from __future__ import annotations

import functools
import math
import statistics

import pytest

from tests import replay as R
from tests import replay_cache as C
from tests import replay_table as T
from tests.replay_rivals import ROWS, Exl3Window, kept_costs


@functools.cache
def cells() -> T.Cells:
    """The cached table when nothing it depends on changed, else the replay run again (about a minute)."""
    return C.fresh_cells() or T.evaluate(T.modes_of(ROWS), seeds=C.SEEDS, reps=C.REPS)


def test_the_cached_table_is_the_replays_table():
    """A cache whose hash no longer matches is stale; it matters when the replay now gives another table: the results
    page and tests/data/replay/table.md would then show numbers the code no longer gives."""
    data = C.stored()
    assert data is not None and (data["seeds"], data["reps"]) == (C.SEEDS, C.REPS)
    assert C.to_json(cells()) == data["cells"], (
        "the policy replay's table changed: run `python -m experiments.policy_replay table --write` and put the "
        "summary it prints into docs/results.md")


def test_auto_holds_the_targets_on_every_trace():
    for (name, c), cell in cells().items():
        over_best, over_ar = cell["auto"]
        if name == "fresh":                    # a fresh policy per request (generate, the app): its own line
            assert over_best >= 0.95 and over_best >= cell["exl3"][0], (name, c, cell["auto"], cell["exl3"])
        elif name == "useless":
            assert over_ar >= 0.98, (name, c, cell["auto"])
        else:
            assert over_best >= 0.97, (name, c, cell["auto"], cell["best"])
            assert over_best >= cell["exl3"][0], (name, c, cell["auto"], cell["exl3"])


def test_auto_beats_the_static_policy_somewhere_and_ar_everywhere_the_drafter_helps():
    got = cells()
    assert max(got[k]["auto"][0] / got[k]["-learn"][0] for k in got) >= 1.05
    assert all(got[k]["auto"][1] >= 1.05 for k in got if k[0] != "useless")


@pytest.mark.parametrize("row", [m for m in ROWS if m.startswith("-")])
def test_each_mechanism_pays(row):
    """Without it `auto` loses >= 1 % somewhere and more than it gains on balance, or misses a target it holds."""
    got = cells()
    gain, loss, held = T.verdict(got, "auto", row)
    balance = statistics.mean(math.log(got[k]["auto"][0] / got[k][row][0]) for k in got)
    assert held or (gain >= 0.01 and balance > 0), (row, gain, loss, balance)


def test_a_new_policy_per_answer_gains_from_the_round_costs_the_earlier_ones_learnt():
    """The app starts every turn's acceptance afresh and keeps the learnt round costs (they describe the machine)."""
    got = T.evaluate({"fresh": ROWS["auto"][1], "kept": kept_costs}, scenarios=["fresh"], seeds=16, reps=10)[("fresh", 1)]
    assert got["kept"][0] >= 1.01 * got["fresh"][0], got


def test_the_table_names_the_best_width_and_every_row():
    text = T.markdown(cells(), {m: label for m, (label, _) in ROWS.items()})
    assert text.count("\n") == len(ROWS) + 2 and "| best fixed width |" in text and "holds" in text


def test_exl3_window_cuts_at_the_calibrated_threshold():
    class Job:
        def __init__(self, conf):
            self.c = conf

        def conf(self):
            return self.c

    win = Exl3Window(positions=4)
    assert win.window([Job([0.0] * 4)]) == 4                     # burn-in: full windows
    for _ in range(40):
        win.label(25.5, True)                                     # a bin that always accepts
        win.label(12.5, False)                                    # one that never does
    assert win.threshold() == 25.0
    assert win.window([Job([30, 20, 30, 30]), Job([30, 30, 30, 10])]) == 3    # the longest cut over the jobs
    for _ in range(40):
        win.label(30.5, False)                                    # the top bin fails: no position passes
    assert win.threshold() == math.inf and win.window([Job([99] * 4)]) == 0


def test_common_draws_give_every_mode_of_a_slot_the_same_costs():
    data = R.load(R.DATA / "costs_h100_noisy.json.gz")
    costs = R.Costs(data, timed_noise=True)
    costs.begin(3)
    got = [costs.round_ms(1, 7, 0) for _ in range(5)]
    assert got == pytest.approx([costs.shape_median(1, 7) * data["noise"][k] for k in range(1, 6)])
    costs.begin(3)
    assert [costs.round_ms(1, 7, 0) for _ in range(5)] == got
    costs.advance(100)
    costs.begin(4)
    assert costs.round_ms(1, 7, 0) == pytest.approx(costs.shape_median(1, 7) * data["noise"][101])
    with pytest.raises(ValueError, match="no noise"):
        R.Costs({k: v for k, v in data.items() if k != "noise"}, timed_noise=True)


def test_fixed_widths_replay_their_tokens():
    costs = R.Costs(R.load(R.DATA / "costs_h100_1206-1042.json.gz"))
    row = {"answer": list(range(40)), "lengths": [3] * 39}
    tokens, ms, rounds = R.replay_request([row], 40, 7, costs, 15, host_ms=0.0, switch_ms=0.0)
    assert tokens == 40 and ms > 0 and rounds == 10         # 1 at prefill, then rounds of 4 (3 accepted + 1), capped
    ar_tokens, ar_ms, ar_rounds = R.replay_request([row], 40, 0, costs, 15, host_ms=0.0, switch_ms=0.0)
    assert ar_tokens == 40 and ar_ms > ms and ar_rounds == 39
