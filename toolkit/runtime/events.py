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

    def to_json(self) -> dict:
        return asdict(self)


def summarize(rounds: list[Round], seconds: float | None = None) -> Summary:
    """Summary of a stream; `seconds` defaults to the sum of the rounds' draft and verify times.

    tau is the mean of accepted+1 over speculative rounds (AR rounds of a drafting policy excluded). Acceptance
    per position i is the share of the rounds that verified position i (len(drafted) > i) that accepted it: every
    speculative round at a fixed width; with a variable width only the rounds whose width reached i, so it is
    conditional on the policy's choice (the policy's own full-width estimate is `Policy.acceptance`).
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
    )


def ar_verdict(ar_rounds: int, spec_rounds: int, share: float = 0.9) -> str:
    """One sentence when a drafting policy decoded at least `share` of a run's rounds as plain AR, else ""."""
    total = ar_rounds + spec_rounds
    if not total or ar_rounds < share * total:
        return ""
    probes = f" ({spec_rounds} probe{'s' if spec_rounds != 1 else ''})" if spec_rounds else ""
    return (f"Drafting does not pay here: the policy decoded {ar_rounds} of {total} rounds as plain AR{probes}, "
            "as its measured round costs and the drafter's acceptance advise.")
