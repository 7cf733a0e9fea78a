"""The shape every backend's Round stream has: a test helper of the CPU tests (test_exl3_backend.py), the GPU test
(test_exl3_gpu.py) and the device check script, which imports it as tests.stream_shape."""

from __future__ import annotations

from toolkit.runtime.events import Round, summarize, tokens_of

FIELDS = {"drafted", "accepted", "bonus", "t_draft_ms", "t_verify_ms", "prefill", "proposed"}


def assert_stream_shape(rounds: list, width: int, max_new_tokens: int, stop_ids: set[int] | None = None) -> None:
    """One prefill round first, then decode rounds each carrying `width` drafted ids (0 = AR); every rejection
    is real (the bonus differs from the rejected draft); the stream ends at the budget or a stop token."""
    assert rounds and all(isinstance(r, Round) for r in rounds)
    assert rounds[0].prefill and not any(r.prefill for r in rounds[1:]), "exactly one prefill round, first"
    assert len(rounds[0].drafted) in (0, width)
    for r in rounds[1:]:
        assert len(r.drafted) == width, f"decode round with {len(r.drafted)} drafted ids, expected {width}"
    for r in rounds[:-1]:                          # the last round may be clipped by the budget or a stop token
        if r.drafted and r.accepted < len(r.drafted):
            assert r.drafted[r.accepted] != r.bonus, f"rejected draft equals the target's token: {r}"
    for r in rounds:
        assert set(r.to_json()) == FIELDS and Round.from_json(r.to_json()) == r
        assert r.t_draft_ms >= 0 and r.t_verify_ms >= 0
    toks = tokens_of(rounds)
    assert 0 < len(toks) <= max_new_tokens
    if stop_ids is not None:
        assert len(toks) == max_new_tokens or toks[-1] in stop_ids
        assert not any(t in stop_ids for t in toks[:-1])
    s = summarize(rounds)
    assert s.tokens == len(toks) and s.rounds == sum(1 for r in rounds[1:] if r.drafted)
    assert len(s.accept_per_position) == (width if s.rounds else 0)
