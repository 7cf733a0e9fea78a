"""One decode of a turn's prompt (timed inside the backend only) and what a finished turn reports: its ratio, its
data for API clients, the policy's widths, and the console line."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from ..benchmark import lockstep
from ..runtime.backend import Backend, GenSettings
from ..runtime.events import Round, Speedup, Summary, summarize
from . import render


@dataclass
class Run:
    """One decode of the prompt, timed inside the backend only."""

    backend: Backend
    ids: list[int]
    settings: GenSettings
    speculative: bool
    rounds: list[Round] = field(default_factory=list)
    seconds: float = 0.0
    stopped: bool = False

    def __post_init__(self) -> None:
        self.transcript = render.Transcript(self.backend.decode)

    def stream(self, stop: threading.Event) -> Iterator[Round]:
        it = self.backend.generate(self.ids, self.settings, speculative=self.speculative)
        try:
            while True:
                if stop.is_set():
                    self.stopped = True
                    return
                t0 = time.perf_counter()
                try:
                    r = next(it)
                except StopIteration:
                    return
                finally:
                    self.seconds += time.perf_counter() - t0
                self.rounds.append(r)
                self.transcript.add(r)
                yield r
        except GeneratorExit:       # the turn was cancelled (Stop, or the client left): no more rounds
            self.stopped = True
            raise
        finally:
            it.close()              # a stopped run ends the backend's generator (exllamav3 frees its jobs' pages)

    @property
    def tokens(self) -> list[int]:
        return [t for r in self.rounds for t in r.tokens]

    def summary(self) -> Summary:
        return summarize(self.rounds, self.seconds)


def speed_of(spec: Run, ar: Run) -> Speedup:
    """The turn's ratio with its spread over the rounds' timings; none when too few rounds drafted."""
    return lockstep.speedup(spec.rounds, ar.rounds, (spec.seconds, ar.seconds))


def result_json(spec: Run, ar: Run, block: int | str, thinking: bool | None, paired: bool = False,
                policy: dict | None = None) -> dict:
    """The turn as data (same keys as `python -m toolkit.generate --compare-ar --json` where they overlap)."""
    s = spec.summary()
    ar_tok_s = len(ar.tokens) / ar.seconds if ar.seconds > 0 else 0.0
    speed = speed_of(spec, ar) if not (spec.stopped or ar.stopped) else Speedup(None, "the run was stopped")
    return {
        "text": spec.transcript.text, "ar_text": ar.transcript.text, "tokens": spec.tokens, "ar_tokens": ar.tokens,
        "rounds": [r.to_json() for r in spec.rounds], "tau": s.tau, "accept_per_position": s.accept_per_position,
        "tau_histogram": {str(k): v for k, v in s.tau_histogram.items()}, "tok_s": s.tok_s, "ar_tok_s": ar_tok_s,
        "seconds": spec.seconds, "ar_seconds": ar.seconds, **speed.to_json(),
        "lossless": spec.tokens == ar.tokens, "block_size": block, "thinking": thinking, "stopped": ar.stopped,
        "lockstep": paired, "policy": policy,
    }


def policy_note(rounds: list[Round]) -> str:
    """What the drafting policy chose over a run: AR rounds and the widths of the speculative ones."""
    steps = [r for r in rounds if not r.prefill]
    spec = [len(r.drafted) for r in steps if r.drafted]
    if not steps:
        return ""
    if not spec:
        return f"block auto: all {len(steps)} rounds plain AR (drafting does not pay on this model and hardware)"
    blocks = sorted({w + 1 for w in spec})
    shown = ", ".join(map(str, blocks)) if len(blocks) <= 4 else f"{blocks[0]}–{blocks[-1]}"
    return (f"block auto: {len(spec)} of {len(steps)} rounds speculative (block {shown}), "
            f"{len(steps) - len(spec)} plain AR")


def request_line(turn: dict, how: str) -> str:
    """The console line of one request: prompt tokens, rounds, the ratio or plain AR, and how it ended."""
    spec, ar = turn["spec"], turn.get("ar")
    steps = [r for r in spec.rounds if not r.prefill]
    drafted = sum(1 for r in steps if r.drafted)
    head = f"request: {turn['prompt']} prompt tokens, block {turn['block']}, {len(spec.tokens)} tokens in {len(steps)} rounds"
    if turn.get("dropped"):
        head += f" ({turn['dropped']} earlier messages left out to fit the context)"
    if "failed" in turn:
        return f"{head}; failed: {turn['failed']}"
    if how == "client left" or spec.stopped or (ar is not None and ar.stopped):
        return f"{head}; {'the client left' if how == 'client left' else 'stopped'} before the end: no ratio"
    if ar is None:
        return f"{head}; ended before the plain AR run"
    speed = speed_of(spec, ar)
    if speed.value is None:
        why = "all plain AR (no round drafted)" if not drafted else f"{drafted} drafted, too few for a ratio"
        return f"{head}, {why}: no ratio"
    return f"{head} ({drafted} drafted); {speed.text()}"
