"""The checkpoint folder of `python -m toolkit.train_drafter`: everything a run needs to go on, small enough to carry.

A run trained in pieces (--time-limit) moves its checkpoint folder between machines, so the folder is laid out for
that:

    CKDIR/.dflash-toolkit.json     the folder's marker (an earlier run's checkpoint folder may be reused)
    CKDIR/state/checkpoint.json    where the run stands (step, planned steps, best, pieces) and the parts' checksums
    CKDIR/state/part.00, ...       the state: weights, AdamW moments, schedule, RNG, the loss and tau log and the
                                   held-out answers, in parts of at most 15 MiB
    CKDIR/best/best.json, part.NN  the weights of the best evaluation so far (written when it changes)
    CKDIR/answers/                 the training answers, when the run generates them itself (no --data)

`state/` is all a resume needs; `best/` is needed only where the drafter is finally written, so the best weights
need not travel to a machine that only trains on. Each of `state/` and `best/` is replaced whole (a new folder
renamed into place), so a run killed while saving leaves the previous checkpoint intact.

--checkpoint-precision says how tensors are stored. `exact`: fp32 weights and moments, so a resumed run is
bit-for-bit the run that was never stopped. `compact` (a quarter of the size): weights in bf16 (their high bytes
compressed; relative error at most 2^-8), the second AdamW moment as 8-bit logarithms per block of 256 (quarter-
octave steps over 63 octaves below the block's largest, so its square root is within 4.4 %; smaller values are
stored as that floor, never as zero, and zeros stay zero), and no first moment: a resumed run rebuilds it from the gradients of the last
20 steps (their batches and anchors are known), which is what it averages (train/pieces.py). The continued run then follows the
uninterrupted one closely, not exactly (tests/test_train_pieces.py states the tolerance). The best weights are
stored in bf16 either way, as the drafter is written.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import struct
from pathlib import Path

import numpy as np
import torch

from ..core import files
from ..core.errors import ToolkitError
from ..core.folders import atomic_dir

PART_BYTES = 15 * 2**20           # each file at most 15 MiB (a device call brings back files of at most 16 MiB)
MAGIC = b"DFLASHCK1\n"
BLOCK = 256                       # elements per scale of the 8-bit moments
LOG_STEPS = 4                     # log8 codes per octave
PRECISIONS = ("exact", "compact")
STATE, BEST, MANIFEST, BEST_MANIFEST = "state", "best", "checkpoint.json", "best.json"


def _pack(chunks: list[bytes], data: bytes, compress: bool) -> list:
    blob = lzma.compress(data, preset=0) if compress else data
    chunks.append(blob)
    return [len(blob), compress]


def encode_tensor(t: torch.Tensor, how: str, chunks: list[bytes]) -> dict:
    """One tensor's entry (and its data appended to `chunks`): `f32` / `raw` exact, `bf16` two byte planes (the high
    one compressed), `q8` int8 per block of BLOCK with fp32 scales, `log8` 8-bit logarithms per block."""
    t = t.detach().cpu().contiguous()
    entry: dict = {"how": how, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if how == "raw" or (how in ("q8", "log8") and t.numel() < BLOCK):
        entry["how"], entry["chunks"] = "raw", [_pack(chunks, t.numpy().tobytes() if t.dtype != torch.bfloat16
                                                       else t.view(torch.int16).numpy().tobytes(), False)]
        return entry
    if how == "f32":
        entry["chunks"] = [_pack(chunks, t.float().numpy().tobytes(), False)]
        return entry
    if how == "bf16":
        planes = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
        entry["chunks"] = [_pack(chunks, planes[:, 1].tobytes(), True), _pack(chunks, planes[:, 0].tobytes(), False)]
        return entry
    flat = t.float().flatten()
    pad = (-flat.numel()) % BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, BLOCK)
    if how == "q8":
        scale = blocks.abs().amax(1) / 127
        codes = torch.round(blocks / scale.clamp_min(1e-38)[:, None]).clamp(-127, 127).to(torch.int8)
    elif how == "log8":
        if (blocks < 0).any():
            raise ToolkitError("a log8 tensor must not be negative")
        scale = blocks.amax(1)
        ratio = blocks / scale.clamp_min(1e-38)[:, None]
        steps = torch.round(-LOG_STEPS * torch.log2(ratio.clamp_min(2.0**-80)))
        codes = torch.where(blocks > 0, steps.clamp(0, 254), torch.full_like(steps, 255)).to(torch.uint8)
    else:
        raise ValueError(how)
    entry["chunks"] = [_pack(chunks, scale.numpy().astype(np.float32).tobytes(), False),
                       _pack(chunks, codes.numpy().tobytes(), True)]
    return entry


def decode_tensor(entry: dict, data: list[bytes]) -> torch.Tensor:
    """The tensor of an entry; `data` holds its chunks, decompressed."""
    how, shape = entry["how"], tuple(entry["shape"])
    dtype = getattr(torch, entry["dtype"])
    n = int(np.prod(shape, dtype=np.int64))
    if how == "raw":
        if dtype == torch.bfloat16:
            return torch.from_numpy(np.frombuffer(data[0], np.int16).copy()).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.frombuffer(data[0], torch.empty(0, dtype=dtype).numpy().dtype).copy()).reshape(shape)
    if how == "f32":
        return torch.from_numpy(np.frombuffer(data[0], np.float32).copy()).reshape(shape).to(dtype)
    if how == "bf16":
        planes = np.stack([np.frombuffer(data[1], np.uint8), np.frombuffer(data[0], np.uint8)], 1)
        out = torch.from_numpy(planes.copy().reshape(-1).view(np.int16)).view(torch.bfloat16).reshape(shape)
        return out if dtype == torch.bfloat16 else out.to(dtype)
    scale = torch.from_numpy(np.frombuffer(data[0], np.float32).copy())
    if how == "q8":
        blocks = torch.from_numpy(np.frombuffer(data[1], np.int8).copy()).view(-1, BLOCK).float() * scale[:, None]
    else:
        codes = torch.from_numpy(np.frombuffer(data[1], np.uint8).copy()).view(-1, BLOCK)
        blocks = torch.where(codes == 255, torch.zeros(()), scale[:, None] * torch.exp2(-codes.float() / LOG_STEPS))
    return blocks.flatten()[:n].reshape(shape).to(dtype)


def encode(tensors: dict[str, tuple[torch.Tensor, str]], record: dict) -> bytes:
    """One blob: MAGIC, the header's length, the header (record and tensor table, JSON), the tensors' chunks."""
    chunks: list[bytes] = []
    table = {name: encode_tensor(t, how, chunks) for name, (t, how) in tensors.items()}
    header = json.dumps({"record": record, "tensors": table}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header + b"".join(chunks)


def decode(blob: bytes, where: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, record) of a blob written by `encode`; anything else is one line naming `where`."""
    try:
        if not blob.startswith(MAGIC):
            raise ValueError("not a checkpoint")
        (n,) = struct.unpack_from("<Q", blob, len(MAGIC))
        start = len(MAGIC) + 8
        head = json.loads(blob[start : start + n].decode())
        pos, out = start + n, {}
        for name, entry in head["tensors"].items():
            data = []
            for length, compressed in entry["chunks"]:
                raw = blob[pos : pos + length]
                pos += length
                data.append(lzma.decompress(raw) if compressed else raw)
            out[name] = decode_tensor(entry, data)
        return out, head["record"]
    except (ValueError, KeyError, TypeError, IndexError, struct.error, lzma.LZMAError, AttributeError) as e:
        raise ToolkitError(f"{where}: not a checkpoint this toolkit can read ({e})") from None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_parts(folder: Path, blob: bytes, manifest: str, summary: dict) -> dict:
    """`folder` replaced whole by the blob in parts of PART_BYTES and a manifest (`summary` + the parts' sizes and
    checksums); returns the manifest."""
    parts = [blob[i : i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)] or [b""]
    man = {**summary, "bytes": len(blob),
           "parts": [{"name": f"part.{k:02d}", "bytes": len(p), "sha256": sha256(p)} for k, p in enumerate(parts)]}
    with atomic_dir(folder, need=len(blob) + 4096) as tmp:
        for meta, data in zip(man["parts"], parts):
            (tmp / meta["name"]).write_bytes(data)
        (tmp / manifest).write_text(json.dumps(man, indent=1) + "\n")
    return man


def read_manifest(folder: Path, manifest: str) -> dict | None:
    """The manifest of a parts folder, or None where there is none."""
    path = folder / manifest
    if not path.is_file():
        return None
    man = files.read_json(path, "--checkpoint-dir")
    ok = (isinstance(man, dict) and isinstance(man.get("parts"), list)
          and all(isinstance(p, dict) and isinstance(p.get("name"), str) and p["name"].startswith("part.")
                  and "/" not in p["name"] and isinstance(p.get("sha256"), str) for p in man["parts"]))
    if not ok:
        raise ToolkitError(f"--checkpoint-dir: {path} is not a checkpoint manifest")
    return man


def read_parts(folder: Path, man: dict) -> bytes:
    """The blob of a parts folder, every part checked against the manifest's checksum."""
    out = []
    for p in man["parts"]:
        path = folder / p["name"]
        if not path.is_file():
            raise ToolkitError(f"--checkpoint-dir: {path} is missing (copy the whole {folder.name}/ folder)")
        data = path.read_bytes()
        if sha256(data) != p["sha256"]:
            raise ToolkitError(f"--checkpoint-dir: {path} is damaged or from another checkpoint (its checksum differs)")
        out.append(data)
    return b"".join(out)
