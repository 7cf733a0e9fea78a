"""Projected speedups from measured round costs at a given tau, and the spread statistics of repeated cells.

Acceptance on synthetic weights is meaningless, so for a real-shape checkpoint the benchmark measures costs only
(t_AR, t_round(w, c)) and projects the speedup at a published tau. A tau alone does not give the per-position
acceptance the policy needs, so the projection assumes a geometric conditional acceptance alpha: position i of
the block is accepted with probability a_i = alpha^i, and alpha solves tau = sum_{i=0}^{B-1} alpha^i (the mean
tokens of a round that verifies all B-1 drafts). A round verifying w drafts then emits sum_{i=0}^{w} alpha^i
tokens on average; exllamav3's default verifies w = B-1 every round, the policy the w with the most tokens per ms.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from ..core.errors import ToolkitError
from ..costs.table import CostTable

# Qwen3.6-35B-A3B + its DFlash drafters, published tau (SGLang, c=1): name -> (tau, block size B)
PUBLISHED = {"DF-16": (7.63, 16), "DF-8": (5.74, 8)}
ASSUMPTION = ("per-position acceptance assumed geometric: a_i = alpha^i with alpha solving tau = sum_{i=0}^{B-1} "
              "alpha^i; exllamav3's defaults verify w = B-1 (num_draft_tokens 15 at B=16) every round, the policy "
              "the w maximising (sum_{i<=w} alpha^i) / t_round(w, c); speedups are against t_AR at the same c")


def parse_taus(items: Iterable[str]) -> list[tuple[str, float, int]]:
    """`published` (both published taus) or TAU@B entries -> [(name, tau, B)]."""
    out: list[tuple[str, float, int]] = []
    for item in items:
        if item.strip().lower() == "published":
            out += [(name, tau, B) for name, (tau, B) in PUBLISHED.items()]
            continue
        tau, _, B = item.partition("@")
        try:
            t, b = float(tau), int(B)
        except ValueError:
            raise ToolkitError(f"--project-tau: {item!r} is not 'published' or TAU@B (e.g. 7.63@16)") from None
        if b < 2 or not 1.0 <= t <= b:
            raise ToolkitError(f"--project-tau: {item!r} needs B >= 2 and 1 <= tau <= B")
        out.append((f"tau {t:g}@{b}", t, b))
    return out


def expected_tokens(alpha: float, block_size: int) -> list[float]:
    """sum_{i=0}^{w} alpha^i for w = 0..B-1."""
    out = [1.0]
    for i in range(1, block_size):
        out.append(out[-1] + alpha ** i)
    return out


def alpha_for(tau: float, block_size: int) -> float:
    """The geometric acceptance alpha with sum_{i=0}^{B-1} alpha^i = tau (bisection; 0 at tau 1, 1 at tau B)."""
    if tau <= 1.0:
        return 0.0
    if tau >= block_size:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, block_size)[-1] < tau else (lo, mid)
    return (lo + hi) / 2


def project(costs: CostTable, concurrency: int, tau: float, block_size: int, t_ar: float | None = None) -> dict:
    """Projected speedups over AR at `tau` for exllamav3's default width (B-1) and the policy's best width.

    `costs` holds t_round(w) at this concurrency (w = 0 being what an AR round costs there); `t_ar` is the plain
    AR step the speedups are measured against (default: the table's w = 0). Where no round beats a plain AR step,
    the policy decodes plain AR (the backend's plain requests): width 0 at t_ar, 1.0x, "plain_ar" True."""
    t = costs.curve(block_size, concurrency)
    t_ar = t[0] if t_ar is None else t_ar
    alpha = alpha_for(tau, block_size)
    n = expected_tokens(alpha, block_size)
    rate = [k / ms for k, ms in zip(n, t)]
    best = max(range(block_size), key=lambda w: (rate[w], -w))
    plain = rate[best] * t_ar < 1.0
    best_rate, best_ms = (1.0 / t_ar, t_ar) if plain else (rate[best], t[best])
    default = block_size - 1
    measured = sorted(w for w in costs.ms[concurrency] if w > 0) if concurrency in costs.ms else []
    return {
        "concurrency": concurrency, "tau": tau, "block_size": block_size, "alpha": round(alpha, 6),
        "t_ar_ms": t_ar, "default_width": default, "default_round_ms": t[default],
        "default_speedup": rate[default] * t_ar, "policy_width": 0 if plain else best, "policy_round_ms": best_ms,
        "policy_speedup": best_rate * t_ar, "policy_over_default": best_rate / rate[default], "plain_ar": plain,
        "extrapolated": bool(measured) and default > measured[-1],
    }


def spread(xs: Sequence[float]) -> dict:
    """Median, min, max and the quartiles of repeated measurements."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q[0], "q3": q[2]}
