"""The speculative loop, shared by the AR baseline and the speculative decoder.

Verification follows exllamav3 and z-lab: the target picks its own token at every block position (argmax,
or a sample at temperature > 0); drafted ids are accepted while they equal the target's picks, and the
target's pick after the accepted prefix is the bonus. Every emitted token is the target's own choice, so
greedy output equals AR output and sampling keeps the target's distribution, whatever width each round
verifies: a `Policy` (policy/chooser.py) picks it per round, 0 being a plain AR round with no drafter call.
"""

from __future__ import annotations

import time
from typing import Iterator, Protocol

from .events import Round
from ..policy.chooser import Policy
from .policy_book import Drive
from .sampling import Sampler


class Steps(Protocol):
    """What a backend does for one sequence. Positions are implicit: the steps keep their own caches."""

    def prefill(self, prompt_ids: list[int]):            # -> logits of the last prompt position [V]
        ...

    def draft_block(self, token: int, width: int) -> list[int]:  # -> `width` drafted ids after `token`
        ...

    def verify(self, block: list[int]):                  # -> target logits at each block position [len, V]
        ...

    def accept(self, n: int) -> None:                    # keep block[:n] in every cache, drop the rest
        ...


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def accepted_prefix(drafted: list[int], target: list[int]) -> int:
    """Length of the longest prefix where the drafted ids equal the target's picks."""
    n = 0
    while n < len(drafted) and drafted[n] == target[n]:
        n += 1
    return n


def clip(tokens: list[int], stop_ids: set[int], budget: int) -> list[int]:
    """Cut emitted tokens after the first stop token and to the remaining budget."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    return tokens[:budget]


def decode(
    steps: Steps,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: set[int],
    draft_width: int = 0,
    policy: Policy | Drive | None = None,
) -> Iterator[Round]:
    """Yield one Round per target forward. Without a policy every round verifies `draft_width` drafts
    (0 = plain AR, B-1 = speculative with block B); with one (or its Drive), its `width()` picks each round's."""
    drive = Drive.of(policy, draft_width)
    t0 = time.perf_counter()
    token = sampler(steps.prefill(prompt_ids))[-1]
    drive.start(0, prompt_ids[-1])
    try:
        rnd = Round(drafted=(), accepted=0, bonus=token, t_verify_ms=_ms(t0), prefill=True)
        drive.observe([(0, (), rnd)])
        yield rnd
        emitted = 1
        while emitted < max_new_tokens and token not in stop_ids:
            width = drive.width(1)
            t0 = time.perf_counter()
            proposal = steps.draft_block(token, drive.draft_len) if width else []
            drafted = proposal[:width]
            t_draft = _ms(t0)

            t0 = time.perf_counter()
            picks = sampler(steps.verify([token] + drafted))
            accepted = accepted_prefix(drafted, picks)
            out = clip(drafted[:accepted] + [picks[accepted]], stop_ids, max_new_tokens - emitted)
            steps.accept(len(out))                      # the cache keeps [token] + accepted drafts
            t_verify = _ms(t0)

            token = out[-1]
            emitted += len(out)
            rnd = Round(tuple(drafted), len(out) - 1, token, t_draft, t_verify, proposed=len(proposal))
            drive.observe([(0, proposal, rnd)], t_draft + t_verify)
            yield rnd
    finally:                                        # a consumer that stops early ends its job too
        drive.end()
