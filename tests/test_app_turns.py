"""A turn as a visitor meets it: both runs in lockstep on a CPU, a ratio only when enough rounds drafted, what
carries from turn to turn (and says so), what the policy learnt, Send busy while a turn runs, refusals that change only
the message line."""

from __future__ import annotations

import html
import pickle
import sys
from pathlib import Path

import gradio as gr
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fakes import OUT, AutoFake, FakeBackend, run  # noqa: E402

from toolkit.app.handlers import ChatHandler  # noqa: E402
from toolkit.app.models import Loaded  # noqa: E402
from toolkit.app.policy_view import SHARED, PolicyStart, learnt_text  # noqa: E402
from toolkit.benchmark import lockstep, ratio  # noqa: E402
from toolkit.policy.chooser import Policy  # noqa: E402
from toolkit.runtime.events import NO_DRAFT, Round  # noqa: E402
from toolkit.runtime.policy_book import PolicyBook  # noqa: E402


class OrderFake(FakeBackend):
    """Records which run produced each round, in order."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.order: list[bool] = []

    def generate(self, prompt_ids, settings, speculative=True):
        for r in super().generate(prompt_ids, settings, speculative):
            self.order.append(speculative)
            yield r


def test_on_a_cpu_both_runs_move_through_the_answer_together():
    be = OrderFake(step_s=0)
    outs = run(ChatHandler(Loaded(be, device="cpu")), block=16, max_new=60)
    res = outs[-1]["result"]
    sizes = iter([len(r["drafted"][: r["accepted"]]) + 1 for r in res["rounds"]])
    spec = ar = 0
    for speculative in be.order:                   # the run behind in the answer goes next (spec on a tie)
        assert speculative == (spec <= ar) or spec >= 60
        if speculative:
            spec += next(sizes)
        else:
            ar += 1
    assert spec == ar == 60
    assert res["lockstep"] is True and res["lossless"] and res["speedup"] > 0
    assert "One lockstep run of each" in html.unescape(outs[-1]["banner"])
    assert any("Both in lockstep" in o["banner"] for o in outs[1:-1] if isinstance(o["banner"], str)) or len(outs) == 2


def test_on_a_gpu_the_runs_go_one_after_the_other():
    be = OrderFake(step_s=0)
    res = run(ChatHandler(Loaded(be, device="cuda")), block=16, max_new=60)[-1]["result"]
    n = be.order.count(True)
    assert be.order == [True] * n + [False] * (len(be.order) - n) and res["lockstep"] is False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_one_drafted_round_gives_no_verdict(device):
    be = AutoFake(step_s=0)
    be.widths = (0,) * 5 + (15,) + (0,) * 40
    last = run(ChatHandler(Loaded(be, device=device)), block="auto", max_new=40)[-1]
    banner, res = html.unescape(last["banner"]), last["result"]
    steps = [r for r in res["rounds"] if not r["prefill"]]
    assert sum(1 for r in steps if r["drafted"]) == 1
    assert res["speedup"] is None and res["speedup_spread"] is None
    assert f"decoded as plain AR: only 1 of {len(steps)} rounds drafted" in res["speedup_reason"]
    assert "No speedup to report" in banner and "×" not in banner
    assert "faster" not in banner and "slower" not in banner


def test_the_drafted_share_rule():
    def rounds(drafted: int, total: int) -> list[Round]:
        return [Round((), 0, 1, prefill=True)] + [Round((2,) if i < drafted else (), 0, 3) for i in range(total)]

    assert ratio.too_few_drafted(rounds(0, 50)) == NO_DRAFT
    assert "only 4 of 50 rounds drafted, too few" in ratio.too_few_drafted(rounds(4, 50))
    assert ratio.too_few_drafted(rounds(5, 50)) is None                       # 1 in 10: a ratio
    assert "only 2 of 4" in ratio.too_few_drafted(rounds(2, 4))               # fewer than 3 drafted rounds
    assert ratio.too_few_drafted(rounds(3, 4)) is None
    assert "only 4 of 150 rounds drafted over 3 repetitions" in ratio.no_ratio(4, 150, reps=3)


def test_timed_lockstep_alternates_and_times_each_side():
    seen = []

    def gen(name, n, width):
        for i in range(n):
            seen.append(name)
            yield Round((7,) * width, width, i)       # width + 1 tokens a round

    rounds, secs = lockstep.timed_lockstep({"a": gen("a", 2, 2), "b": gen("b", 7, 0)})
    assert seen == ["a", "b", "b", "b", "a", "b", "b", "b", "b"] and [len(rounds["a"]), len(rounds["b"])] == [2, 7]
    assert secs["a"] >= 0 and secs["b"] >= 0


class PolicyFake:
    """Stands in for an auto policy: what it has seen, and a cost table that must stay shared."""

    def __init__(self, table):
        self.seen: list[int] = []
        self.costs = type("Costs", (), {"table": table})()


class PolicyBackend(FakeBackend):
    """A backend whose auto policy learns from every speculative run (it records the prompt's length)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.table = {"ms": [1.0, 2.0]}
        self.book = PolicyBook(self.block_size, source=None)
        self.book.policies[(True, "")] = PolicyFake(self.table)
        self.starts: list[bytes] = []

    @property
    def live(self) -> PolicyFake:
        return self.book.policies[(True, "")]

    def encode(self, prompt, system=None, thinking=None):
        text = prompt if isinstance(prompt, str) else " ".join(str(m["content"]) for m in prompt)
        return super().encode(text, system, thinking)

    def generate(self, prompt_ids, settings, speculative=True):
        if speculative:
            self.starts.append(pickle.dumps(self.live.seen))
            self.live.seen.append(len(prompt_ids))
        return super().generate(prompt_ids, settings, speculative)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_turn_starts_from_the_start_up_policy(device):
    be = PolicyBackend(step_s=0)
    h = ChatHandler(Loaded(be, device=device, policy_start=PolicyStart(be)))
    first = [dict(zip(OUT, o)) for o in h.respond("one prompt", [], 16, 10, 0.0, 0, "", False)][-1]
    assert be.live.seen == [len(be.encode("one prompt"))]                      # the turn taught it something
    [dict(zip(OUT, o)) for o in h.respond("a longer other prompt", first["chat"], 16, 10, 0.0, 0, "", False)]
    h2 = ChatHandler(h.loaded)                                                   # another visitor, same process
    [dict(zip(OUT, o)) for o in h2.respond("one prompt", [], 16, 10, 0.0, 0, "", False)]
    assert len(be.starts) == 3 and len(set(be.starts)) == 1                     # every turn saw the same state
    assert be.live.costs.table is be.table                                     # the timed table is shared


def test_the_page_says_what_the_policy_learnt():
    info = {"acceptance": [0.54, 0.28, 0.15, 0.07, 0.02], "proposals": 12, "round_ms": [36.0] + [50.0] * 14 + [113.0],
            "best_block": 1,
            "costs": [{"block": 1, "ms": 36.2, "rounds": 32, "source": "live", "age_s": 1.0, "scale": 1.0},
                      {"block": 16, "ms": 113.0, "rounds": 5, "source": "scaled", "age_s": 200.0, "scale": 0.17}]}
    text = learnt_text(info)
    assert "positions 1-4: 54 %, 28 %, 15 %, 7 % (from 12 proposals)" in text and "plain AR (block 1)" in text
    assert "block 1 (AR) 36 ms (median of 32 live rounds, newest 1 s ago)" in text
    assert "block 16 113 ms (timed, median of 5 rounds, 3 min ago, x0.17 to the live AR rounds)" in text
    assert text.endswith(SHARED)
    assert learnt_text(None) == "" and "still its prior" in learnt_text({**info, "proposals": 0, "best_block": 8})


def test_the_page_and_its_footer_say_what_carries_and_it_does():
    """The footer, the banner and docs/app.md say the same of what is shared; two visitors' turns show it: the round
    costs are one book that grows over both, the acceptance starts over each turn."""
    from toolkit.app.ui import build_app

    assert "Round costs" not in SHARED and "round costs" in SHARED and "acceptance" in SHARED
    assert SHARED in " ".join((Path(__file__).parents[1] / "docs" / "app.md").read_text().split())
    demo = build_app(Loaded(FakeBackend(step_s=0)))
    footer = [b.value for b in demo.blocks.values() if type(b).__name__ == "Markdown"]
    assert any(SHARED in f for f in footer) and not any("same policy state" in f for f in footer)


def test_a_real_auto_turn_shows_what_its_policy_learnt():
    from toolkit.assets.pairs import tiny_pair
    from toolkit.costs.table import CostTable
    from toolkit.runtime.torch_backend import TorchBackend

    be = TorchBackend.from_dirs(*tiny_pair())
    be.book.give(CostTable({1: {w: 10.0 + w for w in range(16)}}, source="given",   # no timing in a unit test
                           counts={1: {w: 5 for w in range(16)}}))
    be.warm_up(be.encode("Hello"))
    start = pickle.dumps(be.book.policies)
    h = ChatHandler(Loaded(be, device="cpu", policy_start=PolicyStart(be)))
    last = [dict(zip(OUT, o)) for o in h.respond("json.dumps", [], "auto", 40, 0.0, 0, "", False)][-1]
    assert pickle.dumps(be.book.policies) != start                              # it learnt in the turn
    pol = last["result"]["policy"]
    assert len(pol["acceptance"]) == 15 and pol["proposals"] > 0 and len(pol["round_ms"]) == 16
    assert [c["block"] for c in pol["costs"]] == list(range(1, 17)) and all(c["rounds"] for c in pol["costs"])
    banner = html.unescape(last["banner"])
    assert "What the policy knows after this turn" in banner and SHARED in banner and "median of" in banner
    learnt = {k: p.costs for k, p in be.book.policies.items()}
    assert learnt and all(c.seen for c in learnt.values())                     # it timed its rounds too
    seen = {k: sum(map(len, c.seen.values())) for k, c in learnt.items()}
    h2 = ChatHandler(h.loaded)                                                  # another visitor's turn
    [dict(zip(OUT, o)) for o in h2.respond("json.dumps", [], "auto", 40, 0.0, 0, "", False)]
    for k, p in be.book.policies.items():                                       # it started over on acceptance,
        assert p.costs is learnt[k] and sum(map(len, p.costs.seen.values())) > seen[k]   # and added to the costs
    h.loaded.policy_start.restore(be)
    for k, p in be.book.policies.items():                                       # the next turn starts over,
        new = Policy(p.block_size, p.costs.table, learn_costs=p.costs.learn)
        assert {a: v for a, v in vars(p).items() if a != "costs"} == {a: v for a, v in vars(new).items() if a != "costs"}
        assert p.costs is learnt[k]                                             # with the machine's round costs


def test_refusals_change_only_the_message_line():
    h = ChatHandler(Loaded(FakeBackend(step_s=0)))
    for prompt in ("", "   "):
        outs = [dict(zip(OUT, o)) for o in h.respond(prompt, [{"role": "user", "content": "hi"}], 16, 8, 0.0, 0, "", False)]
        assert len(outs) == 1
        assert all(outs[0][k] == gr.skip() for k in OUT if k not in ("message", "result"))   # chat, box, panels: untouched
        assert "the prompt is empty" in html.unescape(outs[0]["message"])
        assert outs[0]["result"] == {"error": "Type a message first: the prompt is empty."}   # what an API client reads
    long = "x" * 1100                                                           # refused: it goes back into the box
    out = dict(zip(OUT, next(h.respond(long, [], 16, 8, 0.0, 0, "", False))))
    assert out["box"] == long and out["chat"] == gr.skip() and "exceeds the model's context" in html.unescape(out["message"])


def test_send_is_busy_while_a_turn_runs():
    h = ChatHandler(Loaded(FakeBackend(step_s=0)))
    req = type("Req", (), {"session_hash": "s1"})()
    other = type("Req", (), {"session_hash": "s2"})()
    assert h.claim("hello", req) == (gr.update(interactive=False), "", "hello")   # the box empties, the message goes on
    with pytest.raises(gr.Error, match="your prompt stays in the box"):
        h.claim("next one", req)
    assert h.claim("hi", other)[0] == gr.update(interactive=False)             # another visitor is not blocked
    assert h.release([{"role": "user", "content": "hi"}], req) == (gr.update(interactive=True),
                                                                  [{"role": "user", "content": "hi"}])
    assert h.claim("next one", req)[2] == "next one"
