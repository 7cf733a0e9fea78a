"""safetensors files read without trusting them: the header's structure and the file's length, checked first.

A safetensors file is an 8-byte little-endian header length, a JSON object {name: {dtype, shape, data_offsets}}
(plus an optional `__metadata__`), then the data. Every reader of the toolkit (the drafter loader, the torch
backend's target check, quantize's validation and conversion check) goes through `read_header`, so a truncated
file, a header that is a JSON list or an entry without `data_offsets` is one ToolkitError line naming the file
and the entry, never a traceback from deeper down and never a model with missing weights.
"""

from __future__ import annotations

import errno
import json
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import ToolkitError
from .files import Num, read_json

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER = 100 << 20          # safetensors itself refuses headers over 100 MB


def bad(path: Path, why: str) -> ToolkitError:
    return ToolkitError(f"{path}: not a readable safetensors file ({why})")


def check_entry(path: Path, name: str, entry) -> int:
    """One header entry's structure; returns the end of its data (bytes after the header)."""
    if not isinstance(entry, dict):
        raise bad(path, f"entry {name!r} is a JSON {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(path, f"entry {name!r} has no dtype string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(path, f"entry {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise bad(path, f"entry {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    if dtype in DTYPE_BYTES:
        numel = 1
        for d in shape:
            numel *= d
        if numel * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            raise bad(path, f"entry {name!r}: {dtype} {shape} needs {numel * DTYPE_BYTES[dtype]} bytes, "
                            f"data_offsets cover {offsets[1] - offsets[0]}")
    return offsets[1]


def read_header(path: str | Path) -> dict:
    """The JSON header of one safetensors file, its structure checked and its data checked against the file's length."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise bad(path, f"truncated: {size} bytes, no header")
            (n,) = struct.unpack("<Q", raw)
            if n <= 0 or n > MAX_HEADER or 8 + n > size:
                raise bad(path, f"truncated or corrupt: a header of {n} bytes in a file of {size}")
            text = f.read(n)
    except OSError as e:
        raise ToolkitError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad(path, "corrupt header: not JSON") from None
    if not isinstance(header, dict):
        raise bad(path, f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        raise bad(path, "__metadata__ is not an object")
    end = max((check_entry(path, k, v) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise bad(path, f"truncated: needs {8 + n + end} bytes, has {size}")
    return header


def tensor_shapes(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of one file's tensors, from its checked header."""
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in read_header(path).items() if k != "__metadata__"}


def check_folder(folder: str | Path, what: str = "") -> list[Path]:
    """Every *.safetensors file of a model folder, each header checked, and every shard its index names present.
    `what` (a flag such as "--target") starts each error line."""
    folder, pre = Path(folder), f"{what}: " if what else ""
    files = sorted(folder.glob("*.safetensors"))
    try:
        for f in files:
            read_header(f)
    except ToolkitError as e:
        raise ToolkitError(f"{pre}{e}") from None
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            weight_map = read_json(index).get("weight_map")
        except (ToolkitError, AttributeError):
            raise ToolkitError(f"{pre}{index}: not a readable index (expected a JSON object with a weight_map)") from None
        if not isinstance(weight_map, dict):
            raise ToolkitError(f"{pre}{index}: weight_map is missing or not an object")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not (folder / shard).is_file():
                raise ToolkitError(f"{pre}{index}: tensor {name!r} is in shard {shard!r}, which is not in {folder} (truncated download?)")
    return files


def index_size(folder: str | Path | None) -> int | None:
    """total_size of a folder's safetensors index (a config-only fetch has no weights to measure): a whole number of
    bytes below 2^50 read through core.files; None when there is no index or it holds no such number."""
    for f in sorted(Path(folder).glob("*.safetensors.index.json")) if folder else []:
        try:
            d = read_json(f)
            size = d["metadata"]["total_size"]
        except (ToolkitError, KeyError, TypeError):
            continue
        if Num(0, 2**50, whole=True).ok(size):
            return size
    return None


@contextmanager
def disk_full_as_oserror(path: str | Path) -> Iterator[None]:
    """Re-raise safetensors' full-disk error (a SafetensorError saying "os error 28", also from transformers'
    save_pretrained) as the OSError(ENOSPC) that the atomic writers of core.folders turn into one line."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        if "os error 28" in str(e) or "No space left" in str(e):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        raise


def save_tensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, a full disk raised as OSError(ENOSPC) (see disk_full_as_oserror)."""
    from safetensors.torch import save_file

    with disk_full_as_oserror(path):
        save_file(tensors, str(path), metadata=metadata)
