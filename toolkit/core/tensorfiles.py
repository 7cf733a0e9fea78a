"""safetensors files read without trusting them: the one reader of every model file the toolkit opens.

A safetensors file is an 8-byte little-endian header length, a JSON object {name: {dtype, shape, data_offsets}}
(plus an optional `__metadata__`), then the data, each tensor's bytes back to back. `read_header` checks the
header's structure, each entry's size against its shape, and the spans against the file: a truncated file, a
header that is a JSON list, an entry without `data_offsets`, spans that overlap, leave a gap or run past the end
are one ToolkitError line naming the file and the tensor. `load_tensors`, `iter_tensors` and `read_folder` read the
tensors only after that check, and turn whatever safetensors itself still refuses into the same kind of line;
nothing else in the toolkit loads a safetensors file (tests/test_layout.py holds that). transformers and
exllamav3 open model folders themselves, after `check_folder` has checked every header.
"""

from __future__ import annotations

import errno
import json
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .errors import ToolkitError
from .files import Num, read_json

if TYPE_CHECKING:
    import torch

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
    ends = {k: check_entry(path, k, v) for k, v in header.items() if k != "__metadata__"}
    last = max(ends, key=ends.get, default=None)
    if last is not None and 8 + n + ends[last] > size:
        raise bad(path, f"truncated: needs {8 + n + ends[last]} bytes, has {size} (tensor {last!r} ends past the end)")
    check_spans(path, header, size - 8 - n)
    return header


def check_spans(path: Path, header: dict, data: int) -> None:
    """The tensors' spans cover the `data` bytes after the header back to back, as safetensors requires: an
    overlap, a gap or bytes after the last tensor are one line naming the tensor."""
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")
    at, prev = 0, None
    for begin, end, name in spans:
        if begin < at:
            raise bad(path, f"tensor {name!r} (bytes {begin} to {end}) overlaps tensor {prev!r} (which ends at {at})")
        if begin > at:
            raise bad(path, f"tensor {name!r} starts at byte {begin}, leaving bytes {at} to {begin} to no tensor")
        at, prev = end, name
    if at != data:
        raise bad(path, f"{data - at} bytes after the last tensor{f' ({prev!r})' if prev else ''} belong to no tensor")


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


def iter_tensors(path: str | Path, what: str = "", prefix: str = "") -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, tensor) of one safetensors file, one at a time, after its header is checked; anything safetensors
    still refuses is one line naming the file (and the tensor being read). `what` (a flag) starts each line;
    `prefix`: only the tensors whose names start with it are read."""
    from safetensors import safe_open

    path, pre = Path(path), f"{what}: " if what else ""
    try:
        read_header(path)
    except ToolkitError as e:
        raise ToolkitError(f"{pre}{e}") from None
    name = None
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (SafetensorError, OSError, ...) as one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        at = f" at tensor {name!r}" if name is not None else ""
        raise ToolkitError(f"{pre}{path}: not a readable safetensors file{at} ({reason})") from None


def load_tensors(path: str | Path, what: str = "") -> dict[str, "torch.Tensor"]:
    """Every tensor of one safetensors file, read through `iter_tensors`."""
    return dict(iter_tensors(path, what))


def read_folder(folder: str | Path, what: str = "") -> dict[str, "torch.Tensor"]:
    """Every tensor of a model folder's *.safetensors files (each shard its index names present); a folder with
    none is one line."""
    folder, pre = Path(folder), f"{what}: " if what else ""
    files = check_folder(folder, what)
    if not files:
        raise ToolkitError(f"{pre}{folder}: no *.safetensors files")
    out: dict = {}
    for f in files:
        out.update(iter_tensors(f, what))
    return out


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
