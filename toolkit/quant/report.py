"""Step 6: report.json (schema 1), report.md and tau_top1.png in OUT (the model cards are hub/'s, written by the command)."""

from __future__ import annotations

from ..exl3 import seams

import datetime as dt
import io
import json
from pathlib import Path

from .. import __version__
from ..core.folders import atomic_write
from .convert import write_text
from .recipe import format_bits

SCHEMA = 1
def exllamav3_version(ran: bool) -> str | None:
    """The installed exllamav3's version when it made or measured something in this run (`ran`), else None: a
    report names only the engine that did the work."""
    return seams.version() if ran else None


def made_by_exllamav3(folder: Path) -> bool:
    """Whether a bitrate folder holds exllamav3's output (an EXL3 quantization_config that is not a CPU preview's)."""
    try:
        q = (json.loads((folder / "config.json").read_text()).get("quantization_config") or {})
    except (OSError, ValueError, AttributeError):
        return False
    return q.get("quant_method") == "exl3" and not q.get("preview")


def result_row(item, size_bytes: int, metrics=None, passed: bool | None = None, exl3: dict | None = None) -> dict:
    """One entry of report.json's results; metrics None when the check did not run, exl3 None when τ and speed
    were not measured on exllamav3 (they are with an EXL3 target)."""
    return {
        "bits": float(item.bits), "branch": item.branch, "folder": item.folder, "size_bytes": int(size_bytes),
        "calibrated": bool(item.calibrated),
        "kl": metrics.kl if metrics else None,
        "kl_per_position": list(metrics.kl_per_position) if metrics and metrics.kl_per_position else None,
        "top1": metrics.top1 if metrics else None,
        "top1_per_position": list(metrics.top1_per_position) if metrics and metrics.top1_per_position else None,
        "tau": metrics.tau if metrics else None,
        "exl3": exl3,
        "passed": passed,
    }


def build_report(model: str, revision: str | None, target: str | None, block_size: int, tap_shift: int,
                 device: str | None, bf16_tau: float | None, bf16_size: int, results: list[dict], **extra) -> dict:
    """report.json. `extra`: model_sha, target_sha, target_kind, target_model, model_local, target_local,
    bf16_exl3, exl3_widths, recommended_draft_tokens, steps, memory (None or empty when not known), engine_ran
    (whether exllamav3 converted or measured anything: only then is its version recorded)."""
    return {
        "schema": SCHEMA, "model": model, "revision": revision, "model_sha": extra.get("model_sha"),
        "target": target, "target_sha": extra.get("target_sha"), "target_kind": extra.get("target_kind"),
        "target_model": extra.get("target_model"), "model_local": bool(extra.get("model_local")),
        "target_local": bool(extra.get("target_local")),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "toolkit_version": __version__, "exllamav3_version": exllamav3_version(bool(extra.get("engine_ran"))),
        "block_size": int(block_size), "tap_shift": int(tap_shift), "device": device,
        "bf16": {"tau": bf16_tau, "size_bytes": int(bf16_size), "exl3": extra.get("bf16_exl3")},
        "results": results,
        "recommended_draft_tokens": extra.get("recommended_draft_tokens"),
        "exl3_widths": extra.get("exl3_widths") or [],
        "steps": extra.get("steps") or [],
        "memory": extra.get("memory"),
    }


def _f(v, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _x(m: dict | None, key: str, fmt: str) -> str:
    return "n/a" if not m or m.get(key) is None else format(m[key], fmt)


def _exl3_cells(m: dict | None) -> str:
    return " | ".join(_x(m, k, f) for k, f in (("tau", ".3f"), ("tok_s", ".1f"), ("speedup", ".2f"), ("lossless", ".0%")))


def markdown_table(report: dict) -> str:
    b = report["bf16"]
    rows = ["| bits | calibrated | folder | size (MiB) | KL(BF16‖EXL3) | top-1 | τ | τ exllamav3 | tok/s | speedup | = AR | passed |",
            "|---:|:---:|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
            f"| BF16 | – | (source) | {b['size_bytes'] / 2**20:.1f} | 0 | 1 | {_f(b['tau'], 3)} | {_exl3_cells(b.get('exl3'))} | – |"]
    for r in report["results"]:
        passed = {True: "yes", False: "**no**", None: "n/a"}[r["passed"]]
        rows.append(f"| {format_bits(r['bits'])} | {'yes' if r['calibrated'] else 'no'} | {r['folder']} | "
                    f"{r['size_bytes'] / 2**20:.1f} | {_f(r['kl'])} | {_f(r['top1'])} | {_f(r['tau'], 3)} | "
                    f"{_exl3_cells(r.get('exl3'))} | {passed} |")
    return "\n".join(rows)


def exl3_lines(report: dict) -> list[str]:
    """Where τ and speed were measured, the width sweep and the recommended draft length."""
    m = report["bf16"].get("exl3") or next((r["exl3"] for r in report["results"] if r.get("exl3")), None)
    if not m:
        return []
    bits = f" ({m['target_bits']:.2f} bpw)" if m.get("target_bits") is not None else ""
    lines = [f"τ exllamav3, tok/s and speedup: exllamav3 {report['exllamav3_version']} with the EXL3 target "
             f"`{m['target']}`{bits}, greedy, one prompt at a time, {m['draft_tokens']} draft tokens per round, against "
             f"AR in the same process ({m['ar_tok_s']:.1f} tok/s); \"= AR\": share of prompts whose output equals AR's.", ""]
    sweep = [c for c in report.get("exl3_widths") or [] if c.get("speedup") is not None]
    if sweep:
        lines += ["Draft tokens per round, BF16 drafter: " + ", ".join(
            f"{c['draft_tokens']}: τ {c['tau']:.2f}, {c['speedup']:.2f}×" for c in sweep)
            + f"; recommended: {report.get('recommended_draft_tokens')}", ""]
    return lines


def step_lines(report: dict) -> list[str]:
    """The per-step table: seconds and GPU memory (torch's peak, the device's peak, the plan's estimate)."""
    steps = report.get("steps") or []
    if not steps:
        return []

    def g(v) -> str:
        return "n/a" if v is None else f"{v / 1024**3:.2f}"

    rows = ["| step | seconds | peak allocated (GiB) | peak on device (GiB) | estimated (GiB) |", "|---|---:|---:|---:|---:|"]
    rows += [f"| {s['step']} | {s['seconds']:.1f} | {g(s['peak_allocated_bytes'])} | {g(s['peak_device_bytes'])} | "
             f"{g(s['estimated_bytes'])} |" for s in steps]
    return rows + [""]


def render_markdown(report: dict, notes: list[str] | None = None) -> str:
    sha = f" (commit {report['model_sha']})" if report.get("model_sha") else ""
    tsha = f" (commit {report['target_sha']})" if report.get("target_sha") else ""
    lines = [f"# EXL3 conversion of {report['model']}", "",
             f"- revision: `{report['revision']}`{sha}", f"- target: `{report['target']}`{tsha}",
             f"- block size {report['block_size']}, tap_shift {report['tap_shift']} (toolkit convention: tap L reads "
             f"output of target layer L + tap_shift, exllamav3's convention)",
             f"- exllamav3 {report['exllamav3_version'] or 'not used'}, toolkit {report['toolkit_version']}, "
             f"device {report['device']}",
             f"- created {report['created']}", "", markdown_table(report), "", *exl3_lines(report)]
    cal = {r["bits"] for r in report["results"] if r["calibrated"]}
    unc = {r["bits"] for r in report["results"] if not r["calibrated"]}
    if cal & unc:
        lines += ["Calibrated and uncalibrated were both run for " + ", ".join(format_bits(b) for b in sorted(cal & unc))
                  + " bits; the `-uncal` folders are for comparison and are not pushed.", ""]
    for r in report["results"]:
        if r["kl_per_position"]:
            lines.append(f"- {r['folder']}: top-1 per position " + ", ".join(f"{v:.3f}" for v in r["top1_per_position"]))
        if r.get("exl3"):
            lines.append(f"- {r['folder']}: acceptance per draft position on exllamav3 "
                         + ", ".join(f"{v:.3f}" for v in r["exl3"]["accept_per_position"]))
    for r in [{"folder": "BF16", **report["bf16"]}, *report["results"]]:
        diff = [d for d in (r.get("exl3") or {}).get("first_diff") or [] if d is not None]
        if diff:
            lines.append(f"- {r['folder']}: output left AR's on {len(diff)} of {len(r['exl3']['first_diff'])} prompts, "
                         f"first at token {', '.join(map(str, diff))}")
    lines += [""] + step_lines(report) + [f"- {n}" for n in (notes or [])]
    return "\n".join(lines).rstrip() + "\n"


def tau_of(row: dict) -> float | None:
    """The row's τ: the torch runtime's with a BF16 target, exllamav3's with an EXL3 target."""
    return row["tau"] if row.get("tau") is not None else (row.get("exl3") or {}).get("tau")


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
        tau = [(r["bits"], tau_of(r)) for r in rows if tau_of(r) is not None]
        if top:
            ax1.plot(*zip(*top), style, color="tab:blue", label=f"top-1 ({label})")
        if tau:
            ax2.plot(*zip(*tau), style, color="tab:orange", label=f"τ ({label})")
    if tau_of(report["bf16"]) is not None:
        ax2.axhline(tau_of(report["bf16"]), color="tab:orange", alpha=0.4, linestyle=":", label="τ (BF16)")
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return atomic_write(path, lambda f: f.write(buf.getvalue()))      # a full disk: one line, no partial file


def write_report(out: Path, report: dict, notes: list[str] | None = None) -> list[Path]:
    write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "report.md", render_markdown(report, notes))
    return [out / "report.json", out / "report.md", plot(report, out / "tau_top1.png")]
