"""Streaming safetensors shards: the header is known up front, tensors are generated and written one by one.

Keeps memory flat however large the checkpoint is (one tensor on the host at a time), and writes the
layout exllamav3's compile step writes: `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` when there is more than one shard.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import torch

from ..core.errors import ToolkitError
from .layout import TensorSpec

DTYPE_TAGS = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int16: "I16", torch.int32: "I32"}
SMALL = 1 << 16          # tensors below this many bytes are made on the host (no device round trip)
CHUNK = 64 << 20         # host staging buffer for device tensors


def plan_shards(groups: list[list[TensorSpec]], shard_bytes: int) -> list[list[TensorSpec]]:
    """Tensors split into shards of about `shard_bytes`, breaking only between modules (as the converter does)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for g in groups:
        n = sum(t.nbytes for t in g)
        if size and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1] += g
        size += n
    return [s for s in shards if s]


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05}-of-{n:05}.safetensors" for i in range(n)]


def header_bytes(specs: list[TensorSpec]) -> bytes:
    """The safetensors header (length prefix included) for tensors written back to back in this order."""
    head: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in specs:
        head[t.name] = {"dtype": DTYPE_TAGS[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                      # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class Staging:
    """One reusable host buffer (pinned when CUDA is there) that device tensors pass through on their way
    to the file: no fresh host allocation (and page faults) per tensor."""

    def __init__(self, nbytes: int = CHUNK):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def write(self, f, x: torch.Tensor) -> None:
        flat = x.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            f.write(memoryview(flat.numpy()))
            return
        for a in range(0, flat.numel(), self.buf.numel()):
            part = flat[a:a + self.buf.numel()]
            self.buf[:part.numel()].copy_(part)
            f.write(memoryview(self.buf[:part.numel()].numpy()))


def write_shard(path: Path, specs: list[TensorSpec], make: Callable[[TensorSpec], torch.Tensor],
                progress: Callable[[int], None] | None = None, staging: Staging | None = None) -> int:
    """Write one shard; `make(spec)` returns the tensor (any device). Returns the bytes of tensor data."""
    total = 0
    staging = staging or Staging()
    with open(path, "wb") as f:
        f.write(header_bytes(specs))
        for t in specs:
            x = make(t)
            if tuple(x.shape) != t.shape or x.dtype != t.dtype:
                raise RuntimeError(f"{t.name}: made {tuple(x.shape)} {x.dtype}, planned {t.shape} {t.dtype}")
            staging.write(f, x)
            total += t.nbytes
            if progress:
                progress(t.nbytes)
    return total


def write_index(folder: Path, shards: list[list[TensorSpec]]) -> None:
    names = shard_names(len(shards))
    if len(names) == 1:
        return
    wm = {t.name: name for name, s in zip(names, shards) for t in s}
    total = sum(t.nbytes for s in shards for t in s)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=1))


def check_space(folder: Path, need: int) -> None:
    """A one-line error when the disk cannot hold `need` more bytes (with 2% slack)."""
    free = shutil.disk_usage(folder).free
    if free < need * 1.02:
        raise ToolkitError(f"not enough disk space in {folder}: the checkpoint needs {need / 1e9:.1f} GB, "
                           f"{free / 1e9:.1f} GB is free")


def human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"
