"""Step 4: convert one bitrate with exllamav3's convert_model, in a subprocess, into a temp folder renamed when complete.

`run_converter` is the only place that starts exllamav3; tests replace just that function.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..core import files
from ..core.errors import ToolkitError
from ..core.folders import atomic_file
from ..exl3 import seams
from .plan import STAMP, PlanItem, partial_dir
from .recipe import HALF_RATES, format_bits
from .validate import read_headers

CONVERTER = seams.CONVERTER
# The toolkit's tap_shift has exllamav3's meaning (tap L reads the output of block L + s, HF hidden_states[L + s + 1]),
# so the pinned value is written unchanged; the offset stays as a named constant for drafters of other conventions.
EXL3_TAP_SHIFT_OFFSET = 0


def run_converter(args: list[str], log_path: Path) -> int:
    """Run `python -m exllamav3.conversion.convert_model ARGS`, output to log_path; returns the exit status."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", CONVERTER, *args], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc.returncode


def converter_unavailable() -> str | None:
    """Why conversion cannot run here (no CUDA GPU, no exllamav3), or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU here: EXL3 conversion needs one (use --dry-run to see the plan without a GPU)"
    if seams.version() is None:
        return "exllamav3 is not installed (pip install 'dflash-exl3-toolkit[gpu]'); use --dry-run to see the plan"
    return None


def device_index(device: str | None) -> str:
    if device in (None, "", "cuda", "auto", "cpu"):   # cpu: checks on the CPU, conversion still on GPU 0
        return "0"
    d = str(device).removeprefix("cuda:")
    if not d.replace(",", "").isdigit():
        raise ToolkitError(f"--device: {device!r} is not a CUDA device (cuda, cuda:N or N)")
    return d


def write_override_recipe(path: Path, bits: float, overrides: dict[str, float]) -> Path:
    """exllamav3 --recipe YAML: '*' at the run's bitrate, then the overrides (later entries win)."""
    if not (float(bits).is_integer() or bits in HALF_RATES):
        raise ToolkitError(
            f"overrides: bitrate {format_bits(bits)} cannot be combined with per-tensor overrides "
            f"(exllamav3 recipes take integers 1-8 or 1.5/2.5/3.5)"
        )
    lines = [f"target_bpw: {bits}", "tensors:", f"  '*': {bits:g}"]
    lines += [f"  '{k}': {v:g}" for k, v in overrides.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def converter_args(source: Path, out: Path, work: Path, bits: float, device: str | None,
                   hessians: Path | None, recipe_yaml: Path | None) -> list[str]:
    args = ["-i", str(source), "-o", str(out), "-w", str(work), "-b", format_bits(bits), "-d", device_index(device)]
    if hessians is not None:
        args += ["-hess", str(hessians)]
    if recipe_yaml is not None:
        args += ["-rcp", str(recipe_yaml)]
    return args


def _tail(log: Path, n: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _last_error(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        s = line.strip()
        if s.startswith("!! Error") or s.startswith("AssertionError") or "Error:" in s:
            return s.removeprefix("!! ").strip()
    return None


def check_output(folder: Path, source_headers: dict, keep: list[str]) -> dict:
    """The converted folder holds an exl3 config.json with the DFlash keys and every norm, unquantized."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ToolkitError(f"converter finished but wrote no config.json into {folder}")
    cfg = files.read_object(cfg_path)
    q = cfg.get("quantization_config") or {}
    if q.get("quant_method") != "exl3":
        raise ToolkitError(f"{cfg_path}: quantization_config.quant_method is {q.get('quant_method')!r}, expected 'exl3'")
    if not (cfg.get("dflash_config") or {}).get("target_layer_ids") and "target_layer_ids" not in cfg:
        raise ToolkitError(f"{cfg_path}: the DFlash keys (target_layer_ids) were lost in conversion")
    headers, _ = read_headers(folder)
    for key in keep + (["mask_embedding"] if "mask_embedding" in source_headers else []):
        if key not in headers:
            raise ToolkitError(f"{folder}: tensor {key!r} is missing after conversion")
        if headers[key][1] != source_headers[key][1]:
            raise ToolkitError(f"{folder}: tensor {key!r} changed shape in conversion")
    return cfg


def pin_tap_shift(folder: Path, tap_shift: int) -> None:
    """Write the toolkit's tap_shift into config.json in exllamav3's convention (see EXL3_TAP_SHIFT_OFFSET)."""
    path = folder / "config.json"
    cfg = files.read_object(path)
    cfg.setdefault("dflash_config", {})["tap_shift"] = tap_shift + EXL3_TAP_SHIFT_OFFSET
    cfg.pop("tap_shift", None)
    write_text(path, json.dumps(cfg, indent=4) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write through a temp file (core.folders.atomic_file); a full disk or an unwritable place is one line."""
    try:
        atomic_file(path, text)
    except OSError as e:
        raise ToolkitError(f"cannot write {path} ({e.strerror or e})") from None


def clean(*paths: Path) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()


def convert_bitrate(item: PlanItem, source: Path, out: Path, work_root: Path, source_headers: dict,
                    keep: list[str], model: str, revision: str | None, tap_shift: int,
                    hessians: Path | None = None, overrides: dict | None = None, device: str | None = None) -> Path:
    """Convert one plan row into OUT/<folder>; on any failure nothing of it is left behind."""
    final, part, work = out / item.folder, partial_dir(out, item.folder), work_root / item.folder
    clean(final, part, work)
    work.mkdir(parents=True, exist_ok=True)
    log = work_root / f"{item.folder}.log"
    try:
        recipe_yaml = write_override_recipe(work.parent / f"{item.folder}.recipe.yml", item.bits, overrides) if overrides else None
        rc = run_converter(converter_args(source, part, work, item.bits, device, hessians if item.calibrated else None,
                                          recipe_yaml), log)
        text = _tail(log, 20000)
        if rc != 0:
            if "No space left on device" in text or rc == errno.ENOSPC:
                raise ToolkitError(f"disk full while converting {item.folder} into {out}; removed its partial output")
            hint = _last_error(text)
            raise ToolkitError(
                f"converter crashed on {item.folder} (exit {rc}{': ' + hint if hint else ''}); log {log}; "
                f"rerun to redo this bitrate only"
            )
        err = _last_error(text)
        if not (part / "config.json").is_file():
            raise ToolkitError(f"converter refused {item.folder}: {err or 'no output written'}; log {log}")
        check_output(part, source_headers, keep)
        pin_tap_shift(part, tap_shift)
        write_text(part / STAMP, json.dumps(item.stamp(model, revision)) + "\n")
        os.replace(part, final)
    except BaseException:
        clean(part)
        raise
    finally:
        clean(work)
    return final


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
