"""Read and write drafters in the upstream checkpoint layout (config.json + safetensors), with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ..core.errors import ToolkitError
from ..core.folders import atomic_dir
from ..core.kinds import DFLASH, exl3_tensor, require
from ..core.tensorfiles import read_folder, save_tensors
from .config import DFlashConfig
from .model import DFlashDraft

OPTIONAL = ("mask_embedding",)


def read_tensors(path: str | Path, what: str = "") -> dict[str, torch.Tensor]:
    """All tensors of a model folder's *.safetensors files, through the toolkit's one checked reader
    (core.tensorfiles: each header's structure, spans and length first); a bad file is one line naming it."""
    return read_folder(path, what)


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 what: str = "--draft") -> DFlashDraft:
    """Build the reference drafter from an upstream-layout folder, strictly: the folder must be an unquantized
    DFlash drafter (an HF model or an EXL3 checkpoint is named for what it is), and every tensor must be present,
    of its shape, and used (an unknown tensor is refused, not ignored)."""
    require(path, DFLASH, what)
    config, pre = DFlashConfig.from_dir(path), f"{what}: " if what else ""
    tensors = read_tensors(path, what)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    model = DFlashDraft.skeleton(config)
    state = model.state_dict()
    for name, param in state.items():
        if name not in tensors:
            raise ToolkitError(f"{pre}{path}: missing tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ToolkitError(
                f"{pre}{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
            )
    check_finite(tensors, f"{pre}{path}")
    unknown = sorted(set(tensors) - set(state) - set(OPTIONAL))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        kind = "an EXL3 tensor" if exl3_tensor(unknown[0]) else "a tensor the drafter does not use"
        raise ToolkitError(f"{pre}{path}: unexpected tensor {unknown[0]!r}{more}, {kind}")
    model.load_state_dict({k: tensors[k] for k in state}, strict=True, assign=True)
    if "mask_embedding" in tensors:
        emb = tensors["mask_embedding"].reshape(-1)
        if emb.numel() != config.hidden_size:
            raise ToolkitError(f"{pre}{path}: tensor 'mask_embedding' has {emb.numel()} values, expected {config.hidden_size}")
        model.mask_embedding = torch.nn.Parameter(emb.clone())
    return model.to(device=device, dtype=dtype).eval()


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse NaN or infinite weights: a drafter is never loaded, written or published with them (one line naming
    the first such tensor)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ToolkitError(f"{where}: tensor {name!r} has non-finite weights (NaN or inf)")


def check_finite_model(model: torch.nn.Module, where: str) -> None:
    """Refuse a loaded model, a target as a drafter, with a NaN or infinite weight (one line naming the tensor): it
    would decode nothing but stop tokens or garbage, never an error."""
    for name, p in model.named_parameters():
        check_finite({name: p.detach()}, where)


def save_drafter(model: DFlashDraft, path: str | Path, dtype: torch.dtype = torch.bfloat16, extra_files: dict | None = None,
                 command: str | None = None) -> Path:
    """Write config.json + model.safetensors atomically: a temp folder renamed into place (marked as `command`'s
    output when given). A full disk is one line naming the folder and the bytes needed, and leaves nothing."""
    path = Path(path)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.mask_embedding is not None:
        state["mask_embedding"] = model.mask_embedding.detach().to(dtype).contiguous()
    check_finite(state, f"{path}: not written")
    need = sum(v.numel() * v.element_size() for v in state.values())
    with atomic_dir(path, command=command, need=need) as tmp:
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_tensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return path
