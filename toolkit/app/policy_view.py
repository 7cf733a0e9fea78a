"""The drafting policy as the app uses it: what carries from turn to turn (SHARED), and what the page shows of it.

A backend keeps its auto policies and their round costs in its PolicyBook (`backend.book`, one policy per sampling
mode). The app saves the policies once the start-up is done and gives every turn a fresh copy of that start-up
state (the drafter's acceptance and when to probe start over), joined to the live round costs: those describe the
machine, not a prompt, so they carry from turn to turn and between visitors, one book for the whole process
(costs/book.py). Two visitors asking the same prompt can therefore see different rounds: the later one decodes
with the costs the earlier turns timed.
"""

from __future__ import annotations

from ..costs.book import Cost
from ..runtime.backend import Backend, GenSettings

SHARED = ("Carried from turn to turn and between visitors: the round costs (the start-up timing and every round timed "
          "since, on this machine). Afresh each turn: the drafter's acceptance and when to probe.")


class PolicyStart:
    """The backend's auto policies as the start-up (calibration and warm-up) left them."""

    def __init__(self, backend: Backend | None):
        book = getattr(backend, "book", None)
        self.saved = book.save() if book is not None else None

    def restore(self, backend: Backend) -> None:
        """Give `backend` fresh copies of the saved policies, each with the round costs its live one learnt (SHARED)."""
        if self.saved is not None and backend.book is not None:
            backend.book.restore(self.saved, carry_costs=True)


def cost_json(c: Cost) -> dict:
    return {"block": c.width + 1, "ms": round(c.ms, 2), "rounds": c.rounds, "source": c.source,
            "age_s": None if c.age_s is None else round(c.age_s, 1), "scale": round(c.scale, 3)}


def learnt(backend: Backend, settings: GenSettings) -> dict | None:
    """What the auto policy of `settings` knows after a turn: acceptance per drafted position, how many proposals
    it was learnt from, the round cost of each block (the curve, and each cost it decides by with its rounds, source
    and age), and the block it would pick now."""
    book = backend.book
    got = book.reading(settings.temperature <= 0) if settings.auto and book is not None else None
    if got is None:
        return None
    return {"acceptance": [round(a, 3) for a in got.acceptance], "proposals": got.proposals,
            "round_ms": [round(t, 2) for t in got.round_ms], "costs": [cost_json(c) for c in got.costs],
            "best_block": got.best_width + 1}


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 5400 else f"{seconds / 3600:.1f} h ago"


def cost_text(c: dict) -> str:
    """`block 16: 330 ms (median of 5 live rounds, newest 2 s ago)`; a table value says it was timed, and scaled."""
    name = "block 1 (AR)" if c["block"] == 1 else f"block {c['block']}"
    n = "?" if c["rounds"] is None else c["rounds"]
    if c["source"] == "live":
        how = f"median of {n} live rounds, newest {age_text(c['age_s'])}"
    else:
        how = f"timed, median of {n} rounds, {age_text(c['age_s'])}"
        if c["source"] == "scaled":
            how += f", x{c['scale']:.2f} to the live AR rounds"
    return f"{name} {c['ms']:.0f} ms ({how})"


def learnt_text(info: dict | None) -> str:
    """What the policy knows after this turn, each round cost it decides by with its rounds and age, what it would
    pick now, and what carries to the next turn."""
    if not info or not info["round_ms"]:
        return ""
    acc = ", ".join(f"{100 * a:.0f} %" for a in info["acceptance"][:4])
    parts = [f"drafts accepted at positions 1-4: {acc} (from {info['proposals']} proposals)" if info["proposals"]
             else "no proposal checked yet (acceptance is still its prior)"]
    if info.get("costs"):
        parts.append("round costs it decides by: " + " · ".join(cost_text(c) for c in info["costs"]))
    best = info["best_block"]
    parts.append("it would now pick " + ("plain AR (block 1)" if best == 1 else f"block {best}"))
    return f"What the policy knows after this turn: {'; '.join(parts)}. {SHARED}"
