"""Names for what a user publishes (cards, the report on the Hub, a Space): Hub ids and refs, never a machine path.

A quantize run may read its target from a local folder (how most people run it). report.json keeps what was given
(with `target_local` / `model_local` saying whether it was a folder); everything published goes through
`public_report` / `public_text`, which name
- the target as the Hub model the drafter serves: report.json's `target_model` (quantize --target-model, else the
  recipe's [target] id), else a Hub --target that is not an EXL3 quant, else the upstream card's `base_model`;
- the EXL3 target of the measurements by its Hub ref, else as "a local EXL3 quant at N bpw";
- a local drafter folder by its last component.
Only Hub ids are ever linked.
"""

from __future__ import annotations

import copy
from pathlib import PurePath

from ..core.refs import is_repo_id, is_revision

HUB = "https://huggingface.co"


def split(text: str) -> tuple[str, str | None]:
    repo, at, rev = str(text).partition("@")
    return repo, (rev if at else None)


def is_hub_ref(text: str | None) -> bool:
    """`USER/NAME` or `USER/NAME@REVISION`, not a folder (a leading `/`, `.`, `~`, a backslash or extra slashes)."""
    if not text or str(text).startswith(("/", ".", "~")) or "\\" in str(text):
        return False
    repo, rev = split(text)
    return is_repo_id(repo) and repo.count("/") == 1 and (rev is None or is_revision(rev))


def link(name: str | None, label: str | None = None) -> str:
    """A Markdown link to a Hub id (a revision links its tree); anything else is plain text, never a link."""
    if not name:
        return label or ""
    if not is_hub_ref(name):
        return label or f"`{name}`"
    repo, rev = split(name)
    return f"[{label or name}]({HUB}/{repo}" + (f"/tree/{rev})" if rev else ")")


def target_local(report: dict) -> bool:
    """Whether the run's --target was a local folder (older reports: judged from the name and a missing sha)."""
    if "target_local" in report:
        return bool(report["target_local"])
    t = report.get("target")
    fetched = "target_sha" in report and report["target_sha"] is None and report.get("target_kind") in ("exl3", "hf")
    return bool(t) and (not is_hub_ref(t) or fetched)        # a run that read its target records no Hub sha for a folder


def model_local(report: dict) -> bool:
    if "model_local" in report:
        return bool(report["model_local"])
    return not is_hub_ref(report["model"])


def base_model(metadata: dict) -> str | None:
    bm = metadata.get("base_model")
    bm = bm[0] if isinstance(bm, list) and bm else bm
    return bm if isinstance(bm, str) else None


def served_model(report: dict, upstream_metadata: dict | None = None) -> str | None:
    """The Hub model the drafter serves (USER/NAME), or None when nothing names one."""
    given = report.get("target") if not target_local(report) and report.get("target_kind") != "exl3" else None
    for name in (report.get("target_model"), given, base_model(upstream_metadata or {})):
        if is_hub_ref(name):
            return split(name)[0]
    return None


def exl3_label(target: str | None, bits, local: bool) -> str | None:
    """The EXL3 target of a measurement: its Hub ref, else "a local EXL3 quant at N bpw"."""
    if not target:
        return None
    if not local and is_hub_ref(target):
        return target
    return "a local EXL3 quant" + (f" at {float(bits):.2f} bpw" if bits is not None else "")


def measurements(report: dict) -> list[dict]:
    """Every `exl3` object of a report (bf16's, each result's, the width sweep's)."""
    rows = [report.get("bf16") or {}, *report.get("results", [])]
    found = [r["exl3"] for r in rows if isinstance(r, dict) and isinstance(r.get("exl3"), dict)]
    return found + [w for w in report.get("exl3_widths") or [] if isinstance(w, dict)]


def replacements(report: dict, metadata: dict | None = None) -> dict[str, str]:
    """Local paths in the report -> the names published instead."""
    out: dict[str, str] = {}
    t = report.get("target")
    if t and target_local(report):
        bits = next((m.get("target_bits") for m in measurements(report) if m.get("target_bits") is not None), None)
        served = served_model(report, metadata)
        out[t] = (exl3_label(t, bits, True) if report.get("target_kind") == "exl3"
                  else f"a local copy of {served}" if served else "a local target model")
    if model_local(report):
        out[report["model"]] = PurePath(report["model"]).name or "local drafter"
    return out


def public_report(report: dict, metadata: dict | None = None) -> dict:
    """A copy of report.json fit to publish: `target` is the served Hub model (or None), every measurement's
    target a Hub ref or "a local EXL3 quant at N bpw", a local drafter folder its last component."""
    out = copy.deepcopy(report)
    local = target_local(report)
    for m in measurements(out):
        m["target"] = exl3_label(m.get("target"), m.get("target_bits"),
                                 local if m.get("target") == report.get("target") else not is_hub_ref(m.get("target")))
    out["target"] = out["target_model"] = served_model(report, metadata)
    if model_local(report):
        out["model"] = replacements(report)[report["model"]]
    out.pop("target_local", None)
    return out


def public_text(text: str, report: dict, metadata: dict | None = None) -> str:
    """A text of the run (report.md) with each local path replaced by its published name, longest first."""
    for old, new in sorted(replacements(report, metadata).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(old, new)
    return text


def write_public_reports(report: dict, from_dir, dest, metadata: dict | None = None) -> None:
    """report.json and report.md of the run as published on main: where the run names a local path, the staged
    link is replaced by a copy with its published name (the run's own files stay as they are; without a local
    path the files go up byte for byte)."""
    from pathlib import Path

    if not replacements(report, metadata):
        return
    for name in ("report.json", "report.md"):
        staged, src = Path(dest) / name, Path(from_dir) / name
        if src.is_file():
            staged.unlink(missing_ok=True)
            staged.write_text(public_text(src.read_text(encoding="utf-8", errors="replace"), report, metadata))
