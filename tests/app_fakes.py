"""A scripted Backend for the app tests: known text, a fixed acceptance pattern, optional faults and delays.

The 'target' always continues with the same word sequence, so greedy speculative text equals AR text by
construction of the rounds (drafts agree with that sequence for `accepted` positions, then diverge). AutoFake
scripts the widths of block_size "auto"; run() takes one turn through the app's handler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from toolkit.core.errors import ToolkitError
from toolkit.runtime.backend import Backend, GenSettings
from toolkit.runtime.events import Round

WORDS = ("speculative decoding drafts a block of tokens and the target checks them all in one forward pass so "
         "most tokens cost far less than one target step each while the output stays exactly the same").split()
EOS = 0
OUT = ["chat", "box", "banner", "spec", "ar", "tau", "blocks", "acc", "hist", "message", "result"]     # app outputs


class FakeTokenizer:
    chat_template = "{{ messages }}"   # no enable_thinking: the app must grey out the switch


@dataclass
class FakeBackend(Backend):
    name: str = "fake"
    block_size: int = 16
    max_context: int = 1024
    pattern: tuple[int, ...] = (15, 3, 0, 7, 15, 1, 11, 5)   # accepted drafts per round, cycled
    step_s: float = 0.002            # cost of one target forward (a round, or one AR token)
    fail_at: int | None = None       # raise `fault` before this round index
    fault: BaseException = field(default_factory=lambda: RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    answer_len: int = 400            # the target emits EOS after this many tokens
    eos_ids: tuple[int, ...] = (EOS,)
    tokenizer: object = field(default_factory=FakeTokenizer)
    calls: list = field(default_factory=list)
    produced: int = 0                # rounds yielded by all generate() calls
    closed: int = 0                  # generate() generators closed before their end (GeneratorExit)

    def encode(self, prompt: str | list[dict], system: str | None = None, thinking: bool | None = None) -> list[int]:
        """One id per character of the system prompt and the message (or each message of a conversation)."""
        self.calls.append(("encode", prompt, system, thinking))
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        return [1 + (ord(c) % (len(WORDS) - 1)) for c in (system or "") + text]

    def decode(self, ids: list[int]) -> str:
        return "".join(" " + WORDS[i % len(WORDS)] for i in ids if i != EOS)

    def truth(self, i: int) -> int:
        """The target's i-th generated token."""
        return EOS if i >= self.answer_len else 1 + (i % (len(WORDS) - 1))

    def wrong(self, t: int) -> int:
        """A draft that disagrees with the target's token t."""
        return t + 1 if t + 1 < len(WORDS) else 1

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        if not prompt_ids:
            raise ToolkitError("prompt is empty")
        self.calls.append(("generate", speculative, settings))
        try:
            for r in self._rounds(settings, speculative):
                self.produced += 1
                yield r
        except GeneratorExit:
            self.closed += 1
            raise

    def _rounds(self, settings: GenSettings, speculative: bool) -> Iterator[Round]:
        width = settings.fixed_block(self.block_size) - 1 if speculative else 0      # "auto" drafts the native block
        time.sleep(self.step_s)
        yield Round((), 0, self.truth(0), prefill=True)
        n, k = 1, 0
        while n < settings.max_new_tokens and self.truth(n - 1) != EOS:
            if self.fail_at is not None and k >= self.fail_at:
                raise self.fault
            time.sleep(self.step_s)
            if not width:
                tok = self.truth(n)
                n += 1
                yield Round((), 0, tok)
                continue
            acc = min(self.pattern[k % len(self.pattern)], width)
            drafted = [self.truth(n + i) for i in range(acc)] + [self.wrong(self.truth(n + i)) for i in range(acc, width)]
            out = [self.truth(n + i) for i in range(acc + 1)]
            stop = next((i for i, t in enumerate(out) if t == EOS), None)
            out = out[: stop + 1] if stop is not None else out
            out = out[: settings.max_new_tokens - n]
            n += len(out)
            k += 1
            yield Round(tuple(drafted), len(out) - 1, out[-1])


class AutoFake(FakeBackend):
    """The scripted backend under block_size "auto": widths per round follow a script, 0 being a plain AR round;
    the drafter proposes B-1 ids whenever the width is > 0, as the torch backend's policy does."""

    widths = (0, 0, 0, 5, 15, 0, 0, 3)

    def generate(self, prompt_ids, settings, speculative=True):
        if not (speculative and settings.auto):
            yield from super().generate(prompt_ids, settings, speculative)
            return
        self.calls.append(("generate", speculative, settings))
        yield Round((), 0, self.truth(0), prefill=True)
        n, k = 1, 0
        while n < settings.max_new_tokens and self.truth(n - 1) != EOS:
            w = self.widths[k % len(self.widths)]
            acc = min(2, w)
            drafted = [self.truth(n + i) for i in range(acc)] + [self.wrong(self.truth(n + i)) for i in range(acc, w)]
            out = [self.truth(n + i) for i in range(acc + 1)][: settings.max_new_tokens - n]
            n, k = n + len(out), k + 1
            yield Round(tuple(drafted), len(out) - 1, out[-1], proposed=self.block_size - 1 if w else 0)


def run(handler, prompt="hello", block=16, max_new=40, temperature=0.0, system="", thinking=False):
    """One turn through the app's handler: each update as a dict of the app's outputs (OUT)."""
    return [dict(zip(OUT, o)) for o in handler.respond(prompt, [], block, max_new, temperature, 0, system, thinking)]
