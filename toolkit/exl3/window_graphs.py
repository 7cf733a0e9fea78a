"""What lets a DFlash drafter's sliding-window layers join a whole-forward graph (graphs.py).

exllamav3 keeps each job's window K/V in a short ring per layer and, before every decode step, prepares it on the
host (`SlidingAttention._decode_state_prep`): it shifts a ring that would overflow, and uploads each job's position
in its ring. A captured forward would replay the first call's positions forever. `WindowPreps` stands in for that
preparation on the drafter's window layers: while a forward is captured it hands the layers static position and
page tensors instead, and before every replay it runs exllamav3's own preparation eagerly (the rare shift included)
and copies what it made into those tensors. Eager calls are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class WindowPrep:
    """The instance `_decode_state_prep` of one window layer."""

    def __init__(self, module, owner: WindowPreps):
        self.module, self.owner = module, owner
        self.inner = type(module)._decode_state_prep.__get__(module)
        self.statics: dict[tuple[int, int], tuple] = {}     # (jobs, tokens) -> the page table and positions a graph reads

    def __call__(self, rsg, k_states, v_states, seqlen: int):
        key = (len(rsg), seqlen)
        if self.owner.sink is None:
            bt, lens = self.inner(rsg, k_states, v_states, seqlen)
            if key not in self.statics:                        # made outside any capture, reused by every graph
                self.statics[key] = (torch.empty_like(bt), torch.empty_like(lens))
            return bt, lens
        bt, lens = self.statics[key]
        self.owner.sink.append((self, k_states, v_states, seqlen, bt, lens))
        return bt, lens


class WindowPreps:
    """The window layers' preparations of one drafter; `capture()` around a capture collects what a replay must
    refill, `refill(preps, params)` does it."""

    def __init__(self, modules, is_window: Callable[[object], bool]):
        self.sink: list | None = None
        self.preps = []
        for m in modules:
            if is_window(m) and hasattr(type(m), "_decode_state_prep"):
                prep = WindowPrep(m, self)
                m._decode_state_prep = prep
                self.preps.append(prep)

    def __len__(self) -> int:
        return len(self.preps)

    def start(self) -> None:
        """From now until stop(), the layers read the graph's static tensors (a capture, or a stand-in's replay)."""
        self.sink = []

    def stop(self) -> list:
        got, self.sink = self.sink or [], None
        return got

    @staticmethod
    def refill(recorded: list, params: dict) -> None:
        """exllamav3's preparation of every captured window layer, eagerly, into the graph's static tensors."""
        states = params["recurrent_states"]
        for prep, k_states, v_states, seqlen, bt, lens in recorded:
            got_bt, got_lens = prep.inner(states, k_states, v_states, seqlen)
            bt.copy_(got_bt)
            lens.copy_(got_lens)

    def remove(self) -> None:
        for prep in self.preps:
            if vars(prep.module).get("_decode_state_prep") is prep:
                del prep.module._decode_state_prep
        self.preps = []
