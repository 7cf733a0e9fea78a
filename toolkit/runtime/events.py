"""The one event type of the runtime: a `Round` per speculative round, and summaries over a stream of them.

Every consumer (the generate CLI, the app, the benchmark, the quality checks) reads this stream, whichever
backend produced it. An AR baseline is the same stream with no drafted ids: one token per round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class Round:
    """One verification round.

    drafted:  the drafted ids the target verified this round, rejected ones included: w of them for verify
              width w (B-1 at a fixed full width); empty for the prefill round and for AR rounds.
    accepted: how many leading drafted ids the target agreed with.
    bonus:    the target's own token after the accepted prefix: a correction when accepted < len(drafted),
              a bonus token when the whole block was accepted.
    A round cut short by a stop token or the token budget is clipped: `accepted` then counts only the
    drafted ids that were emitted, and `bonus` is the last emitted token.
    proposed: how many ids the drafter proposed this round; with a drafting policy (runtime/policy.py) it drafts
              all B-1 positions and verifies the first w, so `drafted` is `proposed[:w]`. Defaults to
              len(drafted) (a fixed width, or AR with 0).
    """

    drafted: tuple[int, ...]
    accepted: int
    bonus: int
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0
    prefill: bool = False
    proposed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= len(self.drafted):
            raise ValueError(f"accepted={self.accepted} outside 0..{len(self.drafted)}")
        if self.proposed is None:
            object.__setattr__(self, "proposed", len(self.drafted))
        if self.proposed < len(self.drafted):
            raise ValueError(f"proposed={self.proposed} < {len(self.drafted)} drafted ids")

    @property
    def tokens(self) -> list[int]:
        """The tokens this round emitted, in order."""
        return list(self.drafted[: self.accepted]) + [self.bonus]

    @property
    def full(self) -> bool:
        return bool(self.drafted) and self.accepted == len(self.drafted)

    def to_json(self) -> dict:
        d = asdict(self)
        d["drafted"] = list(self.drafted)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Round":
        return cls(**{**d, "drafted": tuple(d["drafted"])})


def tokens_of(rounds: Iterable[Round]) -> list[int]:
    """The emitted token ids of a stream of rounds."""
    out: list[int] = []
    for r in rounds:
        out.extend(r.tokens)
    return out


@dataclass
class Summary:
    """Acceptance and speed over one stream of rounds."""

    tokens: int = 0
    rounds: int = 0              # speculative rounds (those with drafted ids)
    tau: float = 0.0             # mean accepted+1 over speculative rounds; 1.0 for AR
    accept_per_position: list[float] = field(default_factory=list)  # P(position i accepted | verified), i = 0..B-2
    seconds: float = 0.0
    tok_s: float = 0.0
    tau_histogram: dict[int, int] = field(default_factory=dict)     # accepted+1 -> count
    ar_rounds: int = 0           # decode rounds with no drafted ids (a policy's plain AR rounds; all of an AR run)

    @property
    def drafted(self) -> bool:
        """Whether any round verified drafted ids: without one, a 'speedup' over AR is only timing noise."""
        return self.rounds > 0

    def to_json(self) -> dict:
        return asdict(self)


def summarize(rounds: list[Round], seconds: float | None = None) -> Summary:
    """Summary of a stream; `seconds` defaults to the sum of the rounds' draft and verify times.

    tau is the mean of accepted+1 over speculative rounds (AR rounds of a drafting policy excluded). Acceptance
    per position i is the share of the rounds that verified position i (len(drafted) > i) that accepted it: every
    speculative round at a fixed width; with a variable width only the rounds whose width reached i, so it is
    conditional on the policy's choice (the policy's own full-width estimate is `Policy.rates`).
    """
    spec = [r for r in rounds if r.drafted and not r.prefill]
    tokens = sum(len(r.tokens) for r in rounds)
    if seconds is None:
        seconds = sum(r.t_draft_ms + r.t_verify_ms for r in rounds) / 1000.0
    width = max((len(r.drafted) for r in spec), default=0)
    per_pos, seen = [0.0] * width, [0] * width
    for r in spec:
        for i in range(r.accepted):
            per_pos[i] += 1
        for i in range(len(r.drafted)):
            seen[i] += 1
    hist: dict[int, int] = {}
    for r in spec:
        hist[r.accepted + 1] = hist.get(r.accepted + 1, 0) + 1
    decode = [r for r in rounds if not r.prefill]
    return Summary(
        tokens=tokens,
        rounds=len(spec),
        tau=(sum(r.accepted + 1 for r in spec) / len(spec)) if spec else (1.0 if decode else 0.0),
        accept_per_position=[c / n for c, n in zip(per_pos, seen)],
        seconds=seconds,
        tok_s=tokens / seconds if seconds > 0 else 0.0,
        tau_histogram=dict(sorted(hist.items())),
        ar_rounds=len(decode) - len(spec),
    )


def ar_verdict(ar_rounds: int, spec_rounds: int, share: float = 0.9) -> str:
    """One sentence when a drafting policy decoded at least `share` of a run's rounds as plain AR, else ""."""
    total = ar_rounds + spec_rounds
    if not total or ar_rounds < share * total:
        return ""
    probes = f" ({spec_rounds} probe{'s' if spec_rounds != 1 else ''})" if spec_rounds else ""
    return (f"Drafting does not pay here: the policy decoded {ar_rounds} of {total} rounds as plain AR{probes}, "
            "as its measured round costs and the drafter's acceptance advise.")


NO_DRAFT = ("every round was plain AR: the drafter was never used, so both runs decoded the same way and their "
            "time difference is noise, not a speedup")


@dataclass(frozen=True)
class Speedup:
    """Speculative over AR tok/s, with its spread; `value` is None (and `reason` says why) when it means nothing.

    The spread is min-max over alternating repetitions (`basis` "runs") or, for one run of each, the 5-95 %
    interval of the ratio when the rounds of both runs are resampled (`basis` "rounds")."""

    value: float | None
    reason: str | None = None
    low: float | None = None
    high: float | None = None
    n: int = 1
    basis: str = "runs"
    pair: int | None = None       # the repetition the value is the ratio of (benchmark/ratio.py)

    @property
    def noisy(self) -> bool:
        """Whether the spread reaches both sides of 1.0 (or none was measured): no verdict either way."""
        return self.value is not None and (self.low is None or self.low <= 1.0 <= self.high)

    def spread_text(self) -> str:
        if self.value is None:
            return ""
        if self.low is None:
            return "one run of each: no spread measured"
        what = f"over {self.n} alternating runs" if self.basis == "runs" else "the middle 90 % with the rounds resampled"
        return f"{self.low:.2f}-{self.high:.2f}x, {what}"

    def text(self) -> str:
        """`1.12x (0.98-1.20x over 3 alternating runs)`, or `none (every round was plain AR: ...)`."""
        if self.value is None:
            return f"none ({self.reason})"
        return f"{self.value:.2f}x ({self.spread_text()})"

    def to_json(self) -> dict:
        spread = None if self.low is None else {"min": self.low, "max": self.high, "n": self.n, "basis": self.basis}
        return {"speedup": self.value, "speedup_reason": self.reason, "speedup_spread": spread}


def round_speedup(spec: list[Round], ar: list[Round], seconds: tuple[float, float], draws: int = 400,
                  seed: int = 0) -> Speedup:
    """One run of each: the measured ratio (tokens over `seconds`), and how much it moves when the decode rounds
    of each run are resampled with replacement (their timings carry the load of the moment)."""
    import random

    s_sum, a_sum = summarize(spec, seconds[0]), summarize(ar, seconds[1])
    if not s_sum.drafted:
        return Speedup(None, NO_DRAFT)
    if s_sum.tok_s <= 0 or a_sum.tok_s <= 0:
        return Speedup(None, "nothing was decoded")
    value = s_sum.tok_s / a_sum.tok_s
    rows = [[(len(r.tokens), r.t_draft_ms + r.t_verify_ms) for r in rs if not r.prefill] for rs in (spec, ar)]
    if min(len(r) for r in rows) < 2 or any(sum(ms for _, ms in r) <= 0 for r in rows):
        return Speedup(value)
    rng = random.Random(seed)

    def rate(r: list[tuple[int, float]]) -> float:
        pick = [r[rng.randrange(len(r))] for _ in r]
        ms = sum(m for _, m in pick)
        return sum(t for t, _ in pick) / ms if ms > 0 else 0.0

    point = rate_of(rows[0]) / rate_of(rows[1])
    ratios = sorted(rate(rows[0]) / max(rate(rows[1]), 1e-12) for _ in range(draws))
    lo, hi = ratios[int(0.05 * (draws - 1))], ratios[int(0.95 * (draws - 1))]
    return Speedup(value, None, value * lo / point, value * hi / point, 1, "rounds")


def rate_of(rows: list[tuple[int, float]]) -> float:
    """Tokens per ms over (tokens, ms) rows."""
    ms = sum(m for _, m in rows)
    return sum(t for t, _ in rows) / ms if ms > 0 else 0.0
