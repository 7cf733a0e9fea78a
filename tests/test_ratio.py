"""A speedup only where it means something: none when no round drafted, and always with its spread."""

from __future__ import annotations

import html

import pytest

from toolkit.app import render
from toolkit.runtime.events import NO_DRAFT, Round, Speedup, paired_speedup, round_speedup, summarize


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
    for speed in (round_speedup(rounds([0] * 10, 1.0), ar, (0.01, 0.02)), paired_speedup([200.0], [100.0], False)):
        assert speed.value is None and speed.reason == NO_DRAFT
        assert speed.to_json() == {"speedup": None, "speedup_reason": NO_DRAFT, "speedup_spread": None}
        assert speed.text().startswith("none (every round was plain AR")


def test_paired_ratio_is_the_median_with_min_max():
    speed = paired_speedup([120.0, 90.0, 200.0], [100.0, 100.0, 100.0], True)
    assert speed.value == pytest.approx(1.2) and (speed.low, speed.high, speed.n) == (pytest.approx(0.9), 2.0, 3)
    assert speed.noisy and "0.90-2.00x, over 3 alternating runs" in speed.text()
    one = paired_speedup([150.0], [100.0], True)
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
