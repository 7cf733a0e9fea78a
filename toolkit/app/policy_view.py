"""The drafting policy as the app uses it: every turn starts its acceptance afresh, and the page says what it learnt.

A backend keeps its auto policies in `backend.policies` (one per sampling mode): what they learn (the drafter's
acceptance, the rounds' observed costs, the probing spacing) would otherwise carry from one visitor's prompts to
the next visitor's turn. The app copies them once the start-up is done and gives every turn a fresh copy; the
timed cost table and the round costs the policies learnt on top of it carry from turn to turn (they describe the
machine, not a prompt).
"""

from __future__ import annotations

from ..costs.table import CostTable
from ..policy.chooser import Policy
from ..runtime.backend import Backend, GenSettings, copy_policies


class PolicyStart:
    """The backend's auto policies as the start-up (calibration and warm-up) left them."""

    def __init__(self, backend: Backend | None):
        self.saved = copy_policies(getattr(backend, "policies", None))

    def restore(self, backend: Backend) -> None:
        """Give `backend` fresh copies of the saved policies, each with the round costs its live one learnt: those
        describe the machine, not a prompt, and relearning them cost every turn about 5 rounds per width."""
        if self.saved is None or not hasattr(backend, "policies"):
            return
        fresh = copy_policies(self.saved)
        for key, live in backend.policies.items():
            costs = getattr(live, "costs", None)
            if isinstance(live, Policy) and costs is not None:
                if key not in fresh:
                    fresh[key] = Policy.auto(live.block_size, costs.table, learn_costs=costs.learn)
                fresh[key].costs = costs
        backend.policies = fresh


def learnt(backend: Backend, settings: GenSettings) -> dict | None:
    """What the auto policy of `settings` knows after a turn: acceptance per drafted position, how many proposals
    it was learnt from, the round cost of each block relative to an AR round, and the block it would pick now."""
    pol = backend.auto_policy(settings) if settings.auto else None
    if pol is None:
        return None
    try:
        rates, count = list(pol.rates), int(pol.count)
        costs = pol.costs
        curve = CostTable({1: costs.curve(1)}).curve(pol.block_size, 1) if costs is not None else []
        best = int(pol.best(1))
    except (AttributeError, TypeError, ValueError, IndexError, KeyError):      # a policy without these readings
        return None
    return {"acceptance": [round(a, 3) for a in rates], "proposals": count,
            "round_ms": [round(t, 2) for t in curve], "best_block": best + 1}


def learnt_text(info: dict | None) -> str:
    """One sentence for the page: what the policy learnt in this turn and what it would pick now."""
    if not info or not info["round_ms"]:
        return ""
    acc = ", ".join(f"{100 * a:.0f} %" for a in info["acceptance"][:4])
    t, best = info["round_ms"], info["best_block"]
    parts = [f"drafts accepted at positions 1-4: {acc} (from {info['proposals']} proposals)" if info["proposals"]
             else "no proposal checked yet (acceptance is still its prior)"]
    if t[0] > 0:
        parts.append(f"a block-{len(t)} round costs {t[-1] / t[0]:.1f} AR rounds ({t[-1]:.0f} vs {t[0]:.0f} ms)")
    parts.append("it would now pick " + ("plain AR (block 1)" if best == 1 else f"block {best}"))
    return f"What the policy learnt this turn (every turn starts its acceptance afresh): {'; '.join(parts)}."
