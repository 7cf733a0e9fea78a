"""For the policy and loop tests: a scripted target and drafter (Scripted), a policy whose widths follow a script
(Forced)."""

import torch

from toolkit.costs.table import CostTable
from toolkit.policy.chooser import Policy

B = 16
V = 50


def truth(i: int) -> int:
    """The scripted target's greedy token at output position i."""
    return (7 * i + 3) % V


def linear(t0: float, base: float, per: float, block: int = B) -> CostTable:
    """AR costs t0; a round verifying w >= 1 drafts costs base + per * w."""
    return CostTable({1: {0: t0, **{w: base + per * w for w in range(1, block)}}})


class Scripted:
    """Target: one-hot on truth(). Drafter: right for the first good(n) ids of a block, n = tokens kept so far."""

    def __init__(self, good):
        self.good, self.n = good, 0

    def onehot(self, ids):
        x = torch.full((len(ids), V), -1e9)
        x[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
        return x

    def prefill(self, prompt):
        self.n = 0
        return self.onehot([truth(0)])[-1]

    def draft_block(self, token, width):
        g = self.good(self.n)
        return [truth(self.n + 1 + i) if i < g else (truth(self.n + 1 + i) + 1) % V for i in range(width)]

    def verify(self, block):
        return self.onehot([truth(self.n + 1 + i) for i in range(len(block))])

    def accept(self, n):
        self.n += n


class Forced(Policy):
    """An auto-mode policy (drafts all B-1) whose widths follow a script, cycling."""

    def __init__(self, widths, block=B):
        super().__init__(block, linear(10, 20, 1, block))
        self.script, self.k = widths, 0

    def width(self, jobs: int = 1) -> int:
        self.k += 1
        return self.script[(self.k - 1) % len(self.script)]

