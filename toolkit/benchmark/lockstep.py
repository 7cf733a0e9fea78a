"""Speculative against plain AR on a CPU: both decoders in lockstep, and a ratio only where drafting happened.

On a shared CPU the load of the moment moves a run's speed by more than drafting does, so two runs one after the
other compare two loads. In lockstep the two decoders of the same prompt take turns, the one behind in the answer
going next (a speculative round of five tokens, then five AR rounds), and each side is timed only inside its own
rounds: whatever the machine does falls on both alike. experiments/auto_cpu.py alternates one round of each
instead, which leaves the AR run alone once the speculative one has ended. A ratio follows ratio.py's rule.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from ..runtime.events import Round, Speedup, round_speedup
from .ratio import too_few_drafted


def alternate(gens: Mapping[str, Iterator[Round]]) -> Iterator[tuple[str, Round]]:
    """(name, round) from the generators in lockstep: each step advances the one that has emitted the fewest tokens
    (the first named on a tie), so all move through the answer together and the machine's load of any moment falls
    on each in proportion to its work; one that ends drops out. Closing this closes the generators still running."""
    live = dict(gens)
    emitted = {name: 0 for name in live}
    try:
        while live:
            name = min(live, key=lambda k: emitted[k])          # min() keeps the first of equals
            try:
                r = next(live[name])
            except StopIteration:
                del live[name]
                continue
            emitted[name] += len(r.tokens)
            yield name, r
    finally:
        for g in live.values():
            close = getattr(g, "close", None)
            if close is not None:
                close()


def clocked(gen: Iterator[Round], secs: dict[str, float], name: str) -> Iterator[Round]:
    """`gen`'s rounds, adding the seconds spent inside each to secs[name] (closing this closes `gen`)."""
    try:
        while True:
            t0 = time.perf_counter()
            try:
                r = next(gen)
            except StopIteration:
                return
            finally:
                secs[name] += time.perf_counter() - t0
            yield r
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


def timed_lockstep(gens: Mapping[str, Iterator[Round]]) -> tuple[dict[str, list[Round]], dict[str, float]]:
    """Run the generators in lockstep to their ends: each one's rounds and the seconds spent inside its rounds."""
    rounds: dict[str, list[Round]] = {k: [] for k in gens}
    secs = {k: 0.0 for k in gens}
    for name, r in alternate({k: clocked(iter(g), secs, k) for k, g in gens.items()}):
        rounds[name].append(r)
    return rounds, secs


def speedup(spec: list[Round], ar: list[Round], seconds: tuple[float, float]) -> Speedup:
    """The ratio of one run of each (with its spread over the rounds), or none when too few rounds drafted
    (ratio.py: the rule bench and generate follow too)."""
    why = too_few_drafted(spec)
    return Speedup(None, why) if why else round_speedup(spec, ar, seconds)
