"""Round bookkeeping of the shared loop, with a scripted target and a scripted drafter."""

import pytest

from policy_fakes import Scripted, truth
from toolkit.runtime.events import Round, summarize, tokens_of
from toolkit.runtime.loop import accepted_prefix, clip, decode
from toolkit.runtime.sampling import Sampler

TRUTH = [truth(i) for i in range(400)]   # the target's greedy continuation, position by position


def run(good, width, max_new=64, stop=()):
    return list(decode(Scripted(lambda n: good), [1, 2, 3], max_new, Sampler(), set(stop), width))


@pytest.mark.parametrize("B", [4, 8, 16])
def test_full_accept_gives_B_tokens_per_round(B):
    rounds = run(good=B, width=B - 1, max_new=1 + 5 * B)
    assert rounds[0].prefill and rounds[0].tokens == [TRUTH[0]]
    spec = rounds[1:]
    assert [len(r.tokens) for r in spec] == [B] * 5 and all(r.full for r in spec)
    assert tokens_of(rounds) == TRUTH[: 1 + 5 * B]
    assert summarize(rounds).tau == B


@pytest.mark.parametrize("B", [4, 8, 16])
def test_first_token_reject_gives_one_token_per_round(B):
    rounds = run(good=0, width=B - 1, max_new=20)
    assert all(r.accepted == 0 and len(r.drafted) == B - 1 for r in rounds[1:])
    assert tokens_of(rounds) == TRUTH[:20] and summarize(rounds).tau == 1.0
    assert all(r.bonus != r.drafted[0] for r in rounds[1:])          # the bonus is the target's correction


@pytest.mark.parametrize("good", [1, 3, 6])
def test_partial_accept_and_sums(good):
    B = 8
    rounds = run(good=good, width=B - 1, max_new=50)
    toks = tokens_of(rounds)
    assert toks == TRUTH[:50]
    assert sum(r.accepted + 1 for r in rounds) == len(toks)          # accepted+1 over rounds = tokens emitted
    s = summarize(rounds)
    assert 1 <= s.tau <= B and all(r.accepted <= good for r in rounds[1:])
    assert s.accept_per_position[:good] == pytest.approx([1.0] * good, abs=0.2)
    assert s.accept_per_position[good:] == [0.0] * (B - 1 - good)


def test_ar_is_the_same_loop_with_no_drafts():
    rounds = run(good=0, width=0, max_new=10)
    assert all(r.drafted == () for r in rounds) and tokens_of(rounds) == TRUTH[:10]
    assert summarize(rounds).tau == 1.0


def test_stop_token_clips_the_round():
    stop = TRUTH[11]
    rounds = run(good=16, width=15, max_new=64, stop=[stop])
    toks = tokens_of(rounds)
    assert toks == TRUTH[:12] and toks[-1] == stop
    assert sum(r.accepted + 1 for r in rounds) == 12


def test_max_tokens_clips_the_round():
    rounds = run(good=16, width=15, max_new=10)
    assert tokens_of(rounds) == TRUTH[:10]


def test_helpers():
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 9]) == 2
    assert accepted_prefix([], [5]) == 0
    assert clip([1, 2, 3, 4], {3}, 10) == [1, 2, 3] and clip([1, 2, 3], set(), 2) == [1, 2]
    with pytest.raises(ValueError):
        Round(drafted=(1, 2), accepted=3, bonus=0)
    r = Round(drafted=(4, 5, 6), accepted=2, bonus=9, t_draft_ms=1.0)
    assert Round.from_json(r.to_json()) == r and r.tokens == [4, 5, 9]


def test_a_consumer_that_stops_early_still_ends_its_job():
    """Closing the stream mid-answer (the app's stop button) ends the job in the policy, as a finished one does."""
    from toolkit.runtime.policy_book import Drive

    ended = []

    class Policy:
        draft_len, rates = 3, []

        def start(self, job, last):
            pass

        def width(self, jobs=1):
            return 3

        def observe(self, items, ms=None):
            pass

        def finish(self, job):
            ended.append(job)

    stream = decode(Scripted(lambda n: 2), [1, 2, 3], 64, Sampler(), set(), 3, Drive(Policy()))
    next(stream), next(stream)
    assert ended == []
    stream.close()
    assert ended == [0]
