"""The training curve: loss and teacher-forced tau against the step, as JSON (in training.json) and a PNG plot."""

from __future__ import annotations

from pathlib import Path

from .outputs import write_curve


def curve(losses: list, evals: list[dict], best: dict | None) -> dict:
    """{"loss": [[step, loss]...], "tau": [{"step", "tau", "score"}...], "best": {"step", "score"} or None}."""
    return {"loss": [list(x) for x in losses], "tau": evals, "best": best}


def plot(data: dict, path: str | Path, title: str = "") -> bool:
    """Loss (left axis, log scale) and tau per category at each evaluated block size (right axis) against the step,
    the kept checkpoint marked; written atomically, with the toolkit's marker. False when matplotlib is missing (the JSON still has it all)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if data["loss"]:
        steps, loss = zip(*data["loss"])
        ax.plot(steps, loss, color="0.55", lw=1, label="loss")
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (position-weighted CE)")
    tx = ax.twinx()
    series: dict = {}
    for e in data["tau"]:
        for cat, per in e["tau"].items():
            for b, t in per.items():
                series.setdefault(f"tau {cat} B={b}", []).append((e["step"], t))
    for name, pts in sorted(series.items()):
        xs, ys = zip(*pts)
        tx.plot(xs, ys, marker="o", ms=3, lw=1.5, ls="-" if "B=16" in name else "--", label=name)
    if data.get("best"):
        tx.axvline(data["best"]["step"], color="k", lw=0.8, ls=":", label=f"kept (step {data['best']['step']})")
    tx.set_ylabel("teacher-forced tau (held-out)")
    handles = ax.get_legend_handles_labels()[0] + tx.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + tx.get_legend_handles_labels()[1]
    tx.legend(handles, labels, loc="center right", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    try:
        write_curve(fig, Path(path))
    finally:
        plt.close(fig)
    return True
