"""The one ratio rule of `bench`, `generate` and the app.

- **A ratio only where drafting happened**: at least MIN_DRAFTED_SHARE of the decode rounds (and at least
  MIN_DRAFTED_ROUNDS of them) verified drafted ids, counted over every repetition; otherwise the two runs decoded
  the same way and their ratio is noise, so there is none and the reason says how many of how many rounds drafted,
  over how many repetitions.
- **Pairs**: each repetition ran a speculative and an AR decode back to back (or in lockstep), so its spec/AR ratio
  cancels slow drift. The ratio reported is that of the median repetition (the lower of the middle two for an even
  count), with the min-max over the repetitions.
- **The tok/s beside the ratio** are that repetition's: they imply the ratio printed.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..runtime.events import NO_DRAFT, Round, Speedup

MIN_DRAFTED_SHARE = 0.1     # a ratio needs at least this share of the decode rounds drafted,
MIN_DRAFTED_ROUNDS = 3      # and at least this many of them


def drafted_rounds(rounds: Iterable[Round]) -> tuple[int, int]:
    """(rounds that verified drafted ids, decode rounds), prefill left out."""
    steps = [r for r in rounds if not r.prefill]
    return sum(1 for r in steps if r.drafted), len(steps)


def reps_text(reps: int) -> str:
    return f" over {reps} repetitions" if reps > 1 else ""


def no_ratio(drafted: int, rounds: int, reps: int = 1) -> str | None:
    """Why `drafted` of `rounds` decode rounds (summed over `reps` repetitions) are too few for a ratio, or None."""
    if not rounds or (drafted >= MIN_DRAFTED_ROUNDS and drafted >= MIN_DRAFTED_SHARE * rounds):
        return None
    if not drafted:
        return NO_DRAFT
    return (f"the answer decoded as plain AR: only {drafted} of {rounds} rounds drafted{reps_text(reps)}, too few "
            "for a ratio to measure drafting rather than the machine's noise")


def too_few_drafted(rounds: Iterable[Round], reps: int = 1) -> str | None:
    """no_ratio over a stream of rounds (every repetition's, summed)."""
    return no_ratio(*drafted_rounds(rounds), reps)


def median_pair(spec_tok_s: list[float], ar_tok_s: list[float]) -> int | None:
    """The repetition whose spec/AR ratio is the median (the lower of the middle two), None without a valid pair."""
    valid = [(s / a, k) for k, (s, a) in enumerate(zip(spec_tok_s, ar_tok_s)) if s > 0 and a > 0]
    if not valid:
        return None
    return sorted(valid)[(len(valid) - 1) // 2][1]


def paired(spec_tok_s: list[float], ar_tok_s: list[float], why: str | None = None) -> Speedup:
    """The ratio of the median repetition with the min-max over all, or none with `why` (no_ratio's reason)."""
    if why:
        return Speedup(None, why)
    k = median_pair(spec_tok_s, ar_tok_s)
    if k is None:
        return Speedup(None, "nothing was decoded")
    ratios = [s / a for s, a in zip(spec_tok_s, ar_tok_s) if s > 0 and a > 0]
    value = spec_tok_s[k] / ar_tok_s[k]
    if len(ratios) == 1:
        return Speedup(value, pair=k)
    return Speedup(value, None, min(ratios), max(ratios), len(ratios), "runs", pair=k)
