"""Read and write drafters in the upstream checkpoint layout (config.json + safetensors), with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..core.errors import ToolkitError
from ..core.folders import atomic_dir
from .config import DFlashConfig
from .model import DFlashDraft

OPTIONAL = ("mask_embedding",)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder's *.safetensors files; a bad file is a one-line error naming it."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ToolkitError(f"{path}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    out[k] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ToolkitError(f"{f}: not a readable safetensors file (truncated or corrupt: {reason})") from None
    return out


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DFlashDraft:
    """Build the reference drafter from an upstream-layout folder, checking every tensor's presence and shape."""
    config = DFlashConfig.from_dir(path)
    tensors = read_tensors(path)
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    model = DFlashDraft(config)
    state = model.state_dict()
    for name, param in state.items():
        if name not in tensors:
            raise ToolkitError(f"{path}: missing tensor {name!r}")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ToolkitError(
                f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
            )
    model.load_state_dict({k: tensors[k] for k in state}, strict=True)
    if "mask_embedding" in tensors:
        emb = tensors["mask_embedding"].reshape(-1)
        if emb.numel() != config.hidden_size:
            raise ToolkitError(f"{path}: tensor 'mask_embedding' has {emb.numel()} values, expected {config.hidden_size}")
        model.mask_embedding = torch.nn.Parameter(emb.clone())
    return model.to(device=device, dtype=dtype).eval()


def save_drafter(model: DFlashDraft, path: str | Path, dtype: torch.dtype = torch.bfloat16, extra_files: dict | None = None) -> Path:
    """Write config.json + model.safetensors atomically: a temp folder renamed into place."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
        if model.mask_embedding is not None:
            state["mask_embedding"] = model.mask_embedding.detach().to(dtype).contiguous()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return path
