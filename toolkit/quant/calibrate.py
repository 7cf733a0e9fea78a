"""Step 3: input Hessians H = XᵀX/n of every drafter Linear, in the layout exllamav3's `-hess DIR` reads.

Forward hooks on each nn.Linear see exactly what it multiplies: `fc` the concatenated taps, q the block rows,
k/v the context rows (hidden_norm(fc(taps))) *and* the block rows, o the attention output, gate/up the
post-attention norm output, down act(gate)*up. exllamav3 divides its own capture by the row count and reads a
`hin` file with count 1, so we store the mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from ..core.errors import ToolkitError
from ..core.folders import atomic_dir
from .blocks import Prompt, blocks, run_target


class HessianAccumulator:
    """Sums XᵀX (float32) of the inputs of every nn.Linear under `module`, keyed by qualified name."""

    def __init__(self, module: nn.Module, names: Iterable[str] | None = None):
        wanted = set(names) if names is not None else None
        self.H: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self._handles = []
        for name, m in module.named_modules():
            if isinstance(m, nn.Linear) and (wanted is None or name in wanted):
                self._handles.append(m.register_forward_hook(self._hook(name)))
        if wanted is not None:
            missing = wanted - {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}
            if missing:
                raise ToolkitError(f"calibration: no nn.Linear named {sorted(missing)[0]!r} in the drafter")

    def _hook(self, name: str):
        def hook(mod: nn.Linear, inputs, output) -> None:
            x = inputs[0].detach().reshape(-1, mod.in_features).to(torch.float32)
            if name not in self.H:
                self.H[name] = torch.zeros(mod.in_features, mod.in_features, dtype=torch.float32, device=x.device)
                self.rows[name] = 0
            self.H[name].addmm_(x.T, x)
            self.rows[name] += x.shape[0]
        return hook

    def mean(self) -> dict[str, torch.Tensor]:
        return {k: (h / max(self.rows[k], 1)).cpu() for k, h in self.H.items()}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "HessianAccumulator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_hessians(hessians: dict[str, torch.Tensor], out_dir: Path, rows: dict[str, int] | None = None) -> Path:
    """<key>.safetensors with `hin` (in, in) per Linear, written to a temp folder renamed into place."""
    out_dir = Path(out_dir)
    def cannot(e: OSError) -> ToolkitError:
        return ToolkitError(f"calibration: cannot write Hessians to {out_dir} ({e.strerror or e})")

    try:
        with atomic_dir(out_dir) as tmp:
            try:    # raised inside, so atomic_dir's generic full-disk line does not replace ours
                for key, h in hessians.items():
                    meta = {"rows": str((rows or {}).get(key, 0)), "format": "pt"}
                    save_file({"hin": h.to(torch.float32).contiguous()}, str(tmp / f"{key}.safetensors"), metadata=meta)
            except OSError as e:
                raise cannot(e) from None
    except OSError as e:
        raise cannot(e) from None
    return out_dir


def calibrate(drafter, target, prompt_ids: list[list[int]], keys: list[str], anchors_per_prompt: int,
              out_dir: Path, progress: bool = True, continue_tokens: int = 0) -> dict[str, int]:
    """Run a transformers target over the prompts and the reference drafter over blocks; write the Hessians.
    Returns rows per key."""
    if not prompt_ids:
        raise ToolkitError("calibration: the recipe has no [calibration] prompts (or pass --no-calibrate)")
    shift = drafter.config.tap_shift
    prompts = (run_target(target, ids, drafter.config, [shift], continue_tokens) for ids in prompt_ids)
    return calibrate_prompts(drafter, prompts, target.get_input_embeddings().weight, keys, anchors_per_prompt,
                             out_dir, progress, total=len(prompt_ids))


def calibrate_prompts(drafter, prompts: Iterable[Prompt], embed_weight: torch.Tensor, keys: list[str],
                      anchors_per_prompt: int, out_dir: Path, progress: bool = True,
                      total: int | None = None) -> dict[str, int]:
    """The reference drafter over the draft blocks of prompts already through the target (any kind of target),
    at its configured tap_shift; write the Hessians. Returns rows per key."""
    shift = drafter.config.tap_shift
    with HessianAccumulator(drafter, keys) as acc:
        for prompt in tqdm(prompts, desc="calibrate", unit="prompt", total=total, disable=not progress, leave=False):
            with torch.no_grad():
                for _, noise, ctx, pos in blocks(prompt, drafter, embed_weight, anchors_per_prompt, shift):
                    drafter(noise, ctx, pos)
        missing = [k for k in keys if k not in acc.H]
        if missing:
            raise ToolkitError(f"calibration: {missing[0]!r} saw no input rows (prompts too short?)")
        write_hessians(acc.mean(), out_dir, acc.rows)
        return dict(acc.rows)
