"""Where a GPU backend puts its models: the target on one GPU, split across several, or tensor-parallel, and the
DFlash drafter on one device beside it.

`GpuSplit` is the option set every command that loads a GPU backend shares (generate, bench, eval_tau, quantize's
EXL3 steps, the app):
- `gpu_split`: None (the default: everything on GPU 0), "auto" (every visible GPU) or GB per device (the target's
  layers go to the devices in order, each filled up to its budget, caches included);
- `tensor_parallel`: the target's layers are sharded across the devices, in proportion to the split when one is given;
- `draft_device`: the GPU the drafter (and its cache) is loaded on; DFlash drafters are never split.
How an engine turns it into load arguments is the engine's own (exllamav3: exl3/split.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import OptionError


def parse_split(text) -> str | tuple[float, ...] | None:
    """`auto`, `GB,GB,...` (positive finite numbers) or a list of numbers -> gpu_split."""
    if text is None or text == "" or text == ():
        return None
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        gb = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        gb = ()
    if not gb or any(isinstance(p, bool) for p in parts) or not all(math.isfinite(x) and x > 0 for x in gb):
        raise OptionError("gpu_split", f"must be auto or GB per device separated by commas (e.g. 16,16), "
                                       f"each a positive number; got {text!r}")
    return gb


@dataclass(frozen=True)
class GpuSplit:
    """The target's placement across GPUs and the drafter's device; the defaults put everything on GPU 0."""

    gpu_split: str | tuple[float, ...] | None = None
    tensor_parallel: bool = False
    draft_device: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_split", parse_split(self.gpu_split))
        if not isinstance(self.tensor_parallel, bool):
            raise OptionError("tensor_parallel", f"must be true or false, got {self.tensor_parallel!r}")
        d = self.draft_device
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise OptionError("draft_device", f"must be a GPU index >= 0, got {d!r}")

    @classmethod
    def of(cls, gpu_split=None, tensor_parallel: bool = False, draft_device: int | None = 0) -> GpuSplit:
        """From command-line or environment values (None = the default)."""
        return cls(gpu_split, bool(tensor_parallel), 0 if draft_device is None else draft_device)

    @property
    def default(self) -> bool:
        return self == GpuSplit()

    @property
    def tag(self) -> str:
        """A short name: "one GPU", or e.g. "split 16,16 +tp, drafter cuda:1" (bench rows, cost cache keys)."""
        if self.default:
            return "one GPU"
        s = self.gpu_split
        parts = ["split " + (s if s == "auto" or s is None else ",".join(f"{x:g}" for x in s)) if s else "",
                 "tensor-parallel" if self.tensor_parallel else "",
                 f"drafter cuda:{self.draft_device}" if self.draft_device else ""]
        return ", ".join(p for p in parts if p)

    def check_devices(self, count: int, where: str = "this machine") -> None:
        """One line when this placement needs GPUs this machine (or `where`) does not have."""
        have = f"{where} has {count} GPU{'s' if count != 1 else ''}"
        if isinstance(self.gpu_split, tuple) and len(self.gpu_split) > count:
            raise OptionError("gpu_split", f"lists {len(self.gpu_split)} devices, {have}")
        if self.tensor_parallel and len(self.devices(count)) < 2:
            raise OptionError("tensor_parallel", f"needs two or more GPUs in the split, {have}"
                              + (" with a budget" if count >= 2 else ""))
        if self.draft_device >= count:
            raise OptionError("draft_device", f"is {self.draft_device}, {have} (devices 0 to {count - 1})"
                              if count else f"is {self.draft_device}, {have}")

    def devices(self, count: int) -> list[int]:
        """The GPUs the target may use."""
        s = self.gpu_split
        if isinstance(s, tuple):
            return list(range(min(len(s), count)))
        if s == "auto" or self.tensor_parallel:
            return list(range(count))
        return [0]


def device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- command-line and environment spellings ------------------------------------------------------------------

SPLIT_HELP = ("exllamav3 backend: split the target across GPUs: auto (every visible GPU) or GB per device, e.g. "
              "16,16 (default: everything on GPU 0)")
TP_HELP = "exllamav3 backend: load the target tensor-parallel across the GPUs of --gpu-split (all GPUs without it)"
DRAFT_HELP = "exllamav3 backend: the GPU the DFlash drafter is loaded on (default 0)"
ENV = {"gpu_split": "DFLASH_GPU_SPLIT", "tensor_parallel": "DFLASH_TENSOR_PARALLEL", "draft_device": "DFLASH_DRAFT_DEVICE"}


def add_split_args(ap) -> None:
    """--gpu-split, --tensor-parallel and --draft-device on an argparse parser (dests: the GpuSplit fields)."""
    ap.add_argument("--gpu-split", metavar="auto|GB,GB,...", help=SPLIT_HELP)
    ap.add_argument("--tensor-parallel", action="store_true", help=TP_HELP)
    ap.add_argument("--draft-device", type=int, default=0, metavar="N", help=DRAFT_HELP)


def from_env(env) -> GpuSplit:
    """DFLASH_GPU_SPLIT, DFLASH_TENSOR_PARALLEL (1/true/yes/on) and DFLASH_DRAFT_DEVICE; unset = the defaults."""
    split = (env.get(ENV["gpu_split"]) or "").strip() or None
    tp_raw = (env.get(ENV["tensor_parallel"]) or "").strip().lower()
    if tp_raw not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
        raise OptionError("tensor_parallel", f"({ENV['tensor_parallel']}) must be 1 or 0, got {tp_raw!r}")
    dev_raw = (env.get(ENV["draft_device"]) or "").strip()
    try:
        dev = int(dev_raw) if dev_raw else 0
    except ValueError:
        raise OptionError("draft_device", f"({ENV['draft_device']}) must be a GPU index, got {dev_raw!r}") from None
    return GpuSplit(split, tp_raw in ("1", "true", "yes", "on"), dev)


