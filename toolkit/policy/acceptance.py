"""Acceptance per draft position, learnt in hindsight.

The DFlash drafter proposes all B-1 positions in one forward whatever width is verified, so each proposal is kept
and matched against the tokens the target emits over the next rounds: that gives its full-width accepted length
L, and a_i = P(L >= i) for every position, verified or not.
"""

from __future__ import annotations

from collections.abc import Sequence


class Hindsight:
    """Full-width accepted lengths of one job's proposals, resolved as the target emits its tokens."""

    def __init__(self, last_token: int):
        self.stream = [last_token]               # every emitted token; the last one starts the next block
        self.pending: list[list] = []            # [index of the first predicted token, proposal, matched so far]

    def add(self, proposal: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Record a round (its full proposal, its emitted tokens); return the lengths L it resolved."""
        if proposal:
            self.pending.append([len(self.stream), tuple(proposal), 0])
        self.stream.extend(tokens)
        done, keep = [], []
        for p in self.pending:
            start, ids, j = p
            while j < len(ids) and start + j < len(self.stream) and ids[j] == self.stream[start + j]:
                j += 1
            if j == len(ids) or start + j < len(self.stream):     # all confirmed, or a mismatch seen
                done.append(j)
            else:
                p[2] = j
                keep.append(p)
        self.pending = keep
        return done


class Acceptance:
    """a_i = P(L >= i), i = 1..positions: exponentially weighted running means from a geometric prior."""

    def __init__(self, positions: int, prior: float = 0.6, weight: float = 2.0, decay: float = 0.95):
        self.decay, self.weight = decay, weight
        self.sums = [weight * prior ** i for i in range(1, positions + 1)]
        self.count = 0

    def update(self, length: int) -> None:
        self.weight = self.decay * self.weight + 1.0
        self.sums = [self.decay * s + (i < length) for i, s in enumerate(self.sums)]
        self.count += 1

    def forget(self, weight: float) -> None:
        """Keep the estimates but let them weigh at most `weight` observations (a new answer may differ)."""
        if self.weight > weight:
            k = weight / self.weight
            self.sums, self.weight = [s * k for s in self.sums], weight

    @property
    def rates(self) -> list[float]:
        return [s / self.weight for s in self.sums]

    def expected_tokens(self) -> list[float]:
        """1 + sum_{i<=w} a_i for w = 0..positions: the mean tokens of a round that verifies w drafts."""
        out = [1.0]
        for s in self.sums:
            out.append(out[-1] + s / self.weight)
        return out
