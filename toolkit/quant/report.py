"""Step 6: report.json (schema 1), report.md and tau_top1.png in OUT (the model cards are hub/'s, written by the command)."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
from pathlib import Path

from .. import __version__
from .convert import write_text
from .recipe import format_bits

SCHEMA = 1
EXLLAMAV3_PIN = "1.6.5"


def exllamav3_version() -> str:
    try:
        return importlib.metadata.version("exllamav3")
    except importlib.metadata.PackageNotFoundError:
        return EXLLAMAV3_PIN


def result_row(item, size_bytes: int, metrics=None, passed: bool | None = None) -> dict:
    """One entry of report.json's results; metrics None when the check did not run."""
    return {
        "bits": float(item.bits), "branch": item.branch, "folder": item.folder, "size_bytes": int(size_bytes),
        "calibrated": bool(item.calibrated),
        "kl": metrics.kl if metrics else None,
        "kl_per_position": list(metrics.kl_per_position) if metrics and metrics.kl_per_position else None,
        "top1": metrics.top1 if metrics else None,
        "top1_per_position": list(metrics.top1_per_position) if metrics and metrics.top1_per_position else None,
        "tau": metrics.tau if metrics else None,
        "passed": passed,
    }


def build_report(model: str, revision: str | None, target: str | None, block_size: int, tap_shift: int,
                 device: str | None, bf16_tau: float | None, bf16_size: int, results: list[dict]) -> dict:
    return {
        "schema": SCHEMA, "model": model, "revision": revision, "target": target,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "toolkit_version": __version__, "exllamav3_version": exllamav3_version(),
        "block_size": int(block_size), "tap_shift": int(tap_shift), "device": device,
        "bf16": {"tau": bf16_tau, "size_bytes": int(bf16_size)},
        "results": results,
    }


def _f(v, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def markdown_table(report: dict) -> str:
    rows = ["| bits | calibrated | folder | size (MiB) | KL(BF16‖EXL3) | top-1 | τ | passed |",
            "|---:|:---:|---|---:|---:|---:|---:|:---:|",
            f"| BF16 | – | (source) | {report['bf16']['size_bytes'] / 2**20:.1f} | 0 | 1 | {_f(report['bf16']['tau'], 3)} | – |"]
    for r in report["results"]:
        passed = {True: "yes", False: "**no**", None: "n/a"}[r["passed"]]
        rows.append(f"| {format_bits(r['bits'])} | {'yes' if r['calibrated'] else 'no'} | {r['folder']} | "
                    f"{r['size_bytes'] / 2**20:.1f} | {_f(r['kl'])} | {_f(r['top1'])} | {_f(r['tau'], 3)} | {passed} |")
    return "\n".join(rows)


def render_markdown(report: dict, notes: list[str] | None = None) -> str:
    lines = [f"# EXL3 conversion of {report['model']}", "",
             f"- revision: `{report['revision']}`", f"- target: `{report['target']}`",
             f"- block size {report['block_size']}, tap_shift {report['tap_shift']} (toolkit convention: tap L reads "
             f"output of target layer L + tap_shift, exllamav3's convention)",
             f"- exllamav3 {report['exllamav3_version']}, toolkit {report['toolkit_version']}, device {report['device']}",
             f"- created {report['created']}", "", markdown_table(report), ""]
    cal = {r["bits"] for r in report["results"] if r["calibrated"]}
    unc = {r["bits"] for r in report["results"] if not r["calibrated"]}
    if cal & unc:
        lines += ["Calibrated and uncalibrated were both run for " + ", ".join(format_bits(b) for b in sorted(cal & unc))
                  + " bits; the `-uncal` folders are for comparison and are not pushed.", ""]
    for r in report["results"]:
        if r["kl_per_position"]:
            lines.append(f"- {r['folder']}: top-1 per position " + ", ".join(f"{v:.3f}" for v in r["top1_per_position"]))
    lines += [""] + [f"- {n}" for n in (notes or [])]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> Path:
    """τ and top-1 against bits, calibrated and uncalibrated as separate lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(6, 4), dpi=100)
    ax2 = ax1.twinx()
    for cal, style in ((True, "-o"), (False, "--s")):
        rows = sorted((r for r in report["results"] if r["calibrated"] == cal), key=lambda r: r["bits"])
        label = "calibrated" if cal else "uncalibrated"
        top = [(r["bits"], r["top1"]) for r in rows if r["top1"] is not None]
        tau = [(r["bits"], r["tau"]) for r in rows if r["tau"] is not None]
        if top:
            ax1.plot(*zip(*top), style, color="tab:blue", label=f"top-1 ({label})")
        if tau:
            ax2.plot(*zip(*tau), style, color="tab:orange", label=f"τ ({label})")
    if report["bf16"]["tau"] is not None:
        ax2.axhline(report["bf16"]["tau"], color="tab:orange", alpha=0.4, linestyle=":", label="τ (BF16)")
    ax1.set_xlabel("bits per weight")
    ax1.set_ylabel("top-1 agreement with BF16", color="tab:blue")
    ax2.set_ylabel("τ (tokens per round)", color="tab:orange")
    ax1.set_title(report["model"].split("/")[-1] + " EXL3")
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    if handles:
        ax1.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize=8)
    else:
        ax1.text(0.5, 0.5, "not measured (run with --check)", ha="center", transform=ax1.transAxes)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_report(out: Path, report: dict, notes: list[str] | None = None) -> list[Path]:
    write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "report.md", render_markdown(report, notes))
    return [out / "report.json", out / "report.md", plot(report, out / "tau_top1.png")]
