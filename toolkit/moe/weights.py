"""What the MoE forwards take: plain tensors and formats, never an engine's objects.

An EXL3 linear y = x @ W (W of shape (in, out)) is an `Exl3Weight`: its packed trellis, its two sign/scale
vectors and its format (bits per weight and codebook); ref.py states what the tensors hold. An engine's adapter
builds these from its own modules (exllamav3: toolkit/exl3/moe.py) and hands a layer over as a `MoeLayer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Exl3Weight:
    """One EXL3 linear as tensors and format. `in_features` / `out_features` default to the trellis' tiles."""

    trellis: torch.Tensor             # int16 [in/16, out/16, 16*K]
    suh: torch.Tensor                 # fp16 [in]
    svh: torch.Tensor                 # fp16 [out]
    K: float                          # bits per weight: 1..8, or 1.5 / 2.5 / 3.5 (mul1)
    mcg: bool = False                 # the MCG codebook
    mul1: bool = False                # the MUL1 codebook (neither: 3INST)
    in_features: int = 0
    out_features: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.trellis, torch.Tensor) or self.trellis.dim() != 3:
            raise TypeError(f"an Exl3Weight's trellis is a 3-d int16 tensor, got {type(self.trellis).__name__}")
        if not self.in_features:
            object.__setattr__(self, "in_features", self.trellis.shape[0] * 16)
        if not self.out_features:
            object.__setattr__(self, "out_features", self.trellis.shape[1] * 16)


@dataclass
class MoeLayer:
    """One MoE layer's EXL3 weights: experts e = 0..E-1 as (gate, up, down) and an optional shared expert whose
    output is scaled by sigmoid(x @ shared_gate) when a shared gate vector [hidden] is given."""

    gates: list[Exl3Weight]
    ups: list[Exl3Weight]
    downs: list[Exl3Weight]
    shared: tuple[Exl3Weight, Exl3Weight, Exl3Weight] | None = None
    shared_gate: torch.Tensor | None = None

    def __post_init__(self) -> None:
        given = [*self.gates, *self.ups, *self.downs, *(self.shared or ())]
        odd = next((w for w in given if not isinstance(w, Exl3Weight)), None)
        if odd is not None:
            raise TypeError(f"a MoeLayer holds Exl3Weight, got {type(odd).__name__}: an engine's adapter extracts "
                            "its linears' tensors first (exllamav3: toolkit.exl3.moe.module_layer)")
        if self.shared_gate is not None and not isinstance(self.shared_gate, torch.Tensor):
            raise TypeError(f"a MoeLayer's shared gate is a tensor, got {type(self.shared_gate).__name__}")

    @property
    def hidden(self) -> int:
        return self.gates[0].in_features

    @property
    def inter(self) -> int:
        return self.gates[0].out_features
