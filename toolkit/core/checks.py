"""Checks of numeric and device options, done before any work: one OptionError naming the field.

A command validates its numbers here as soon as it starts, so nan, inf, zero or a negative count never reach a
loop that would run for nothing, divide by zero or fail an hour later; a device that is not there (`--device cuda`
on a machine without a GPU, `cuda:3` on a machine with one) is refused in the same way.
"""

from __future__ import annotations

import math
import re

from .errors import OptionError

SEED_MAX = 2**63 - 1        # torch.manual_seed takes a signed 64-bit value
DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+|mps)$")


def whole(field: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError(field, f"must be a whole number, got {value!r}")
    if lo is not None and value < lo or hi is not None and value > hi:
        span = f"from {lo} to {hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise OptionError(field, f"must be {span}, got {value}")
    return value


def number(field: str, value, lo: float | None = None, hi: float | None = None, above: float | None = None) -> float:
    """A finite number in [lo, hi], and > `above` when given (nan and inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptionError(field, f"must be a finite number, got {value!r}")
    if above is not None and not value > above:
        raise OptionError(field, f"must be > {above:g}, got {value:g}")
    if lo is not None and value < lo or hi is not None and value > hi:
        span = f"from {lo:g} to {hi:g}" if lo is not None and hi is not None else f">= {lo:g}" if lo is not None else f"<= {hi:g}"
        raise OptionError(field, f"must be {span}, got {value:g}")
    return float(value)


def seed(field: str, value) -> int:
    return whole(field, value, 0, SEED_MAX)


def device(field: str, value: str, auto: bool = False) -> str:
    """cpu, cuda, cuda:N or mps (and `auto` where allowed), and only one that this machine has."""
    if auto and value == "auto":
        return value
    if not isinstance(value, str) or not DEVICE_RE.match(value):
        allowed = "auto, cpu, cuda or cuda:N" if auto else "cpu, cuda or cuda:N"
        raise OptionError(field, f"{value!r} is not a device: use {allowed}")
    if value.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise OptionError(field, f"{value}: no CUDA GPU is available here")
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= torch.cuda.device_count():
            raise OptionError(field, f"{value}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if value == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise OptionError(field, "mps: no Apple GPU is available here")
    return value
