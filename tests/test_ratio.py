"""A speedup only where it means something: none when no round drafted, and always with its spread."""

from __future__ import annotations

import html

import pytest

from toolkit.app import render
from toolkit.benchmark import lockstep, ratio
from toolkit.runtime.events import NO_DRAFT, Round, Speedup, round_speedup, summarize


def rounds(widths: list[int], ms: float, accepted: int = 1) -> list[Round]:
    """A prefill, then one round per width (0 = plain AR), each taking about `ms`."""
    out = [Round((), 0, 1, t_verify_ms=ms, prefill=True)]
    for i, w in enumerate(widths):
        drafted = tuple(range(2, 2 + w))
        out.append(Round(drafted, min(accepted, w), 9, t_draft_ms=ms / 4 if w else 0.0,
                         t_verify_ms=ms * (1 + 0.1 * (i % 3))))
    return out


def test_summary_counts_plain_ar_rounds_and_whether_it_drafted():
    s = summarize(rounds([0, 0, 15, 0], 2.0))
    assert (s.rounds, s.ar_rounds, s.drafted) == (1, 3, True)
    assert not summarize(rounds([0, 0, 0], 2.0)).drafted


def test_no_round_drafted_means_no_ratio():
    ar = rounds([0] * 10, 2.0)
    for speed in (round_speedup(rounds([0] * 10, 1.0), ar, (0.01, 0.02)), ratio.paired([200.0], [100.0], NO_DRAFT)):
        assert speed.value is None and speed.reason == NO_DRAFT
        assert speed.to_json() == {"speedup": None, "speedup_reason": NO_DRAFT, "speedup_spread": None}
        assert speed.text().startswith("none (every round was plain AR")


def test_paired_ratio_is_the_median_with_min_max():
    speed = ratio.paired([120.0, 90.0, 200.0], [100.0, 100.0, 100.0])
    assert speed.value == pytest.approx(1.2) and (speed.low, speed.high, speed.n) == (pytest.approx(0.9), 2.0, 3)
    assert speed.pair == 0 and ratio.paired([1.0, 3.0], [1.0, 1.0]).value == 1.0    # even: the lower middle pair
    assert speed.noisy and "0.90-2.00x, over 3 alternating runs" in speed.text()
    one = ratio.paired([150.0], [100.0])
    assert one.low is None and one.noisy and "no spread measured" in one.text()


def test_one_run_each_gets_an_interval_from_its_rounds():
    spec, ar = rounds([15] * 30, 4.0, accepted=7), rounds([0] * 240, 2.0)
    speed = round_speedup(spec, ar, (0.2, 0.5))
    assert speed.basis == "rounds" and speed.low < speed.value < speed.high
    assert speed.value == pytest.approx(summarize(spec, 0.2).tok_s / summarize(ar, 0.5).tok_s)
    assert not speed.noisy and speed.value > 1


def test_banner_never_shows_a_ratio_next_to_all_plain_ar():
    plain = render.banner_html("done", (20, 0.02), (20, 0.03), identical=True, speed=Speedup(None, NO_DRAFT),
                               widths="block auto: all 19 rounds plain AR (drafting does not pay on this model and hardware)")
    text = html.unescape(plain)
    assert "No speedup to report" in text and "×" not in text and "faster" not in text and "slower" not in text
    even = html.unescape(render.banner_html("done", (20, 0.02), (20, 0.03), identical=True,
                                            speed=Speedup(1.43, None, 0.8, 2.1, 1, "rounds")))
    assert "≈ AR speed (1.43×)" in even and "× faster" not in even and "reaches both sides of 1×" in even
    fast = html.unescape(render.banner_html("done", (20, 0.01), (20, 0.03), identical=True,
                                            speed=Speedup(2.3, None, 2.1, 2.5, 1, "rounds")))
    assert "2.30× faster" in fast and "2.10-2.50x" in fast
    slow = html.unescape(render.banner_html("done", (20, 0.05), (20, 0.01), identical=True,
                                            speed=Speedup(0.2, None, 0.18, 0.22, 1, "rounds")))
    assert "0.20× (slower here)" in slow and "costs more than it saves" in slow


def test_one_ratio_rule_over_bench_generate_and_the_app():
    """The same repetitions give bench, generate and the app the same verdict, value and pair; counts over
    repetitions say so."""
    from toolkit import generate as gen
    from toolkit.bench import mark_ratios

    def surfaces(spec_runs, ar_runs):
        rate = [sum(len(x.tokens) for x in r) / s for r, s in spec_runs]
        ar_rate = [sum(len(x.tokens) for x in r) / s for r, s in ar_runs]
        hist: dict[int, int] = {}
        for r, _ in spec_runs:
            for x in r:
                if not x.prefill:
                    hist[len(x.drafted)] = hist.get(len(x.drafted), 0) + 1
        cell = {"concurrency": 1, "tok_s_reps": rate, "width_histogram": hist}
        mark_ratios([{"concurrency": 1, "tok_s_reps": ar_rate}], [cell])
        g = gen.compare_speed(spec_runs, ar_runs)
        return cell, g

    sparse = rounds([15] * 4 + [0] * 66, 2.0)               # 4 of 70 rounds drafted
    ar = rounds([0] * 80, 2.0)
    for reps in (1, 3):
        cell, g = surfaces([(sparse, 0.2)] * reps, [(ar, 0.2)] * reps)
        assert cell["speedup"] is None and g.value is None and cell["speedup_reason"] == g.reason
        assert f"only {4 * reps} of {70 * reps} rounds drafted" in g.reason
        assert ("over 3 repetitions" in g.reason) == (reps == 3)
    app = lockstep.speedup(sparse, ar, (0.2, 0.2))           # what the app's speed_of calls
    assert app.value is None and app.reason == surfaces([(sparse, 0.2)], [(ar, 0.2)])[1].reason

    dense = rounds([15] * 30, 4.0, accepted=7)
    spec_runs, ar_runs = [(dense, t) for t in (0.2, 0.3, 0.25)], [(ar, t) for t in (0.5, 0.5, 0.4)]
    cell, g = surfaces(spec_runs, ar_runs)
    assert cell["speedup"] == pytest.approx(g.value) and g.pair == cell["pair"]["rep"] == gen.pair_of(spec_runs, ar_runs)
    assert cell["pair"]["tok_s"] / cell["pair"]["ar_tok_s"] == pytest.approx(g.value)
    one = lockstep.speedup(dense, ar, (0.2, 0.5))
    assert one.value == pytest.approx(surfaces(spec_runs[:1], ar_runs[:1])[1].value)
