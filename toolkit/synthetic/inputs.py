"""synth()'s inputs, checked before torch loads: the options, --out (core.folders' output policy) and the config it
imitates; bad input is one line at once, and the writer (build.py) is imported only for a run that can go ahead."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..core import checks
from ..core.errors import ToolkitError
from ..core.folders import claim, read_json

BITS = range(1, 9)
CODEBOOKS = ("mul1", "mcg", "3inst")
ROUTINGS = ("random", "skewed")


@dataclass
class SynthInputs:
    """Validated inputs of synth()."""

    config: Path
    bits: int
    out: Path
    head_bits: int = 6
    codebook: str = "mul1"
    seed: int = 0
    std: float | None = None
    shard_gb: float = 4.0
    device: str = "cpu"
    overwrite: bool = False
    quiet: bool = False
    routing: str = "random"
    mtp_bits: int = 4


def whole_bits(value: float, flag: str, allow16: bool = False) -> int:
    ok = float(value).is_integer() and (int(value) in BITS or (allow16 and int(value) == 16))
    if not ok:
        extra = " or 16 (unquantized)" if allow16 else ""
        raise ToolkitError(f"{flag} must be an integer from 1 to 8{extra}, got {value:g} "
                           "(exllamav3's half rates 1.5/2.5/3.5 are not synthesised)")
    return int(value)


def resolve_device(device: str | None) -> str:
    """auto: cuda when this machine has a GPU, else cpu (the one input that needs torch, so it is resolved last)."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ToolkitError(f"--device {device}: no CUDA GPU is available here")
    return checks.device("device", device)          # cpu, cuda or cuda:N that this machine has


def read_shape(path: Path) -> dict:
    if path.is_dir():                                # a model folder: its config.json
        path = path / "config.json"
    cfg = read_json(path, "--config ")
    if not isinstance(cfg, dict):
        raise ToolkitError(f"--config {path}: expected a JSON object")
    return cfg


def check_inputs(config: str, bits: float, out: str, head_bits: float = 6, codebook: str = "mul1", seed: int = 0,
                 std: float | None = None, shard_gb: float = 4.0, device: str | None = None, overwrite: bool = False,
                 quiet: bool = False, routing: str = "random", mtp_bits: float = 4) -> tuple[SynthInputs, dict]:
    """synth()'s arguments checked, --out claimed and the config read: (the inputs, the config), or one line."""
    if codebook not in CODEBOOKS:
        raise ToolkitError(f"--codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")
    if routing not in ROUTINGS:
        raise ToolkitError(f"--routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if not shard_gb > 0:
        raise ToolkitError(f"--shard-gb must be positive, got {shard_gb}")
    checks.number("shard_gb", shard_gb, hi=1024.0)
    checks.seed("seed", seed)
    if std is not None:
        checks.number("std", std, above=0.0)
    out = claim(out, "synth", overwrite, force_flag="--overwrite")     # before any work: docs/outputs.md
    o = SynthInputs(Path(config), whole_bits(bits, "--bits"), Path(out), whole_bits(head_bits, "--head-bits", allow16=True),
                    codebook, seed, std, shard_gb, "cpu", overwrite, quiet, routing,
                    whole_bits(mtp_bits, "--mtp-bits", allow16=True))
    cfg = read_shape(o.config)
    o.std = float(std if std is not None else cfg.get("initializer_range") or (cfg.get("text_config") or {}).get("initializer_range") or 0.02)
    if not (o.std > 0 and math.isfinite(o.std)):
        raise ToolkitError(f"--std must be a positive number, got {o.std}")
    o.device = resolve_device(device)
    return o, cfg
