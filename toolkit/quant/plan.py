"""Step 2: the plan, one row per bitrate (and calibration mode): folder, branch, expected size, resume state."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..core import files
from ..core.errors import ToolkitError
from ..core.folders import sweep
from ..dflash import DFlashConfig
from .recipe import branch_name, format_bits
from .validate import expected_shapes, linear_keys

MANIFEST = ".quantize-run.json"  # in OUT: the model it is a run of, so a rerun may resume it
STAMP = ".quantize.json"         # written into a bitrate folder as its last file: its presence means complete
UNCAL = "-uncal"


@dataclass
class PlanItem:
    bits: float
    calibrated: bool
    folder: str               # under OUT
    branch: str               # Hub branch it is pushed to (exllamav3 convention: 4.0bpw)
    expected_bytes: int
    status: str = "todo"      # todo | done | partial (half-written: redone from scratch)
    pushed: bool = True       # an -uncal comparison folder next to a calibrated one is not pushed

    def stamp(self, model: str, revision: str | None) -> dict:
        return {"bits": self.bits, "calibrated": self.calibrated, "model": model, "revision": revision}


def expected_size(config: DFlashConfig, bits: float) -> int:
    """EXL3 bytes: bits/8 per Linear weight + fp16 sign/scale vectors per Linear + fp16 norms."""
    shapes = expected_shapes(config)
    total = 0.0
    linears = {k + ".weight" for k in linear_keys(config)}
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        if name in linears:
            total += n * bits / 8 + 2 * (shape[0] + shape[1])
        else:
            total += 2 * n
    return int(total)


def partial_dir(out: Path, folder: str) -> Path:
    return out / f".{folder}.partial"


def folder_status(out: Path, item: PlanItem, model: str, revision: str | None) -> str:
    final, part = out / item.folder, partial_dir(out, item.folder)
    stamp = final / STAMP
    if stamp.is_file():
        try:
            if files.read_json(stamp) == item.stamp(model, revision):
                return "done"
        except ToolkitError:
            pass
        return "partial"
    return "partial" if final.exists() or part.exists() else "todo"


def check_out_dir(out: Path, manifest: dict, force: bool) -> None:
    """A non-empty OUT must be an earlier run of the same model (resume), unless --force; what a killed run left
    in it (its temp files) does not count."""
    sweep(out, inside=True)
    if force or not out.exists() or not any(out.iterdir()):
        return
    m = out / MANIFEST
    prev = None
    if m.is_file():
        try:
            prev = files.read_json(m)
        except ToolkitError:
            prev = None
    if prev != manifest:
        raise ToolkitError(f"--out: {out} exists and is not a resumable run of {manifest['model']}; pass --force to overwrite it")


def make_plan(config: DFlashConfig, bits: list[float], out: Path, model: str, revision: str | None,
              calibrate: bool, also_uncalibrated: bool = False, force: bool = False) -> list[PlanItem]:
    items = []
    for b in bits:
        modes = [True, False] if calibrate and also_uncalibrated else [calibrate]
        for cal in modes:
            suffix = UNCAL if (not cal and calibrate) else ""
            folder = branch_name(b) + suffix
            item = PlanItem(b, cal, folder, folder, expected_size(config, b), pushed=not suffix)
            item.status = "todo" if force else folder_status(out, item, model, revision)
            items.append(item)
    return items


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_plan(items: list[PlanItem], out: Path) -> str:
    rows = [("bits", "calibrated", "folder", "branch", "expected size", "status", "pushed")]
    for i in items:
        rows.append((format_bits(i.bits), "yes" if i.calibrated else "no", str(out / i.folder), i.branch,
                     human_bytes(i.expected_bytes), i.status, "yes" if i.pushed else "no"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_json(items: list[PlanItem]) -> list[dict]:
    return [asdict(i) for i in items]
