"""The expert-grouped EXL3 MoE forward: a call's (row, expert) picks sorted by expert and run in five Triton launches
per layer: the sort, the input rotation, gate+up (each touched expert's weights decoded once per block of up to
`bm` of its rows), down, and a fixed-order sum per token. The shared expert rides along as one more expert when its
format matches the routed ones. The decode is exllamav3's own arithmetic (ref.py states the format), so the weights
multiplied are bit-identical to exllamav3's dequantisation; the rest agrees to fp16 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ref import CODEBOOK_IDS, HAD, codebook_of, split_rate
from .weights import Exl3Weight, MoeLayer

MAX_SORT = 4096                 # assignments the one-program sort takes


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: rows per GEMM block, k per decode step, warps, pipeline stages, and whether the decode uses
    exllamav3's PTX instructions (None: on NVIDIA GPUs, off on the CPU interpreter and ROCm)."""

    bm: int = 16
    bk: int = 32
    warps: int = 8
    stages: int = 3
    asm: bool | None = None

    def use_asm(self, device: torch.device) -> bool:
        if self.asm is not None:
            return self.asm
        return device.type == "cuda" and torch.version.hip is None


def kernels():
    """The Triton kernels (imported on first use: importing this module needs no Triton)."""
    from . import grouped_kernels

    return grouped_kernels


def group_shape(K: float) -> tuple[int, int]:
    """(RG, CG): rows and columns of a decode group, G = RG * CG consecutive positions whose windows lie in two
    consecutive 32-bit words (8 up to 4 bits, 2 at 7 bits, 4 otherwise and at the half rates)."""
    ka, half = split_rate(K)
    if half or ka in (5, 6, 8):
        return 4, 1
    return (2, 1) if ka == 7 else (4, 2)


def fmt(lin: Exl3Weight) -> tuple[int, int, int]:
    """(KA, HALF, codebook id) of an EXL3 weight."""
    ka, half = split_rate(lin.K)
    return ka, half, CODEBOOK_IDS[codebook_of(lin)]


def decode_inner(lin: Exl3Weight, asm: bool | None = None) -> torch.Tensor:
    """The rotated-basis weight (in, out) fp16 of an EXL3 weight, decoded by the grouped path's decode."""
    k, n = lin.in_features, lin.out_features
    ka, half, cb = fmt(lin)
    rg, cg = group_shape(lin.K)
    bk, bn = (64 if k % 64 == 0 else 16), (64 if n % 64 == 0 else 16)
    out = torch.empty((k, n), dtype=torch.float16, device=lin.trellis.device)
    use = KernelConfig(asm=asm).use_asm(lin.trellis.device)
    kernels().decode_kernel[(k // bk, n // bn)](lin.trellis, out, n, KA=ka, HALF=half, CB=cb, ASM=use, BK=bk, BN=bn,
                                                RG=rg, CG=cg)
    return out


_HAD: dict = {}


def hadamards(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(had_in, had_out) [128, 128] fp16, unnormalised Sylvester H with its columns (in) / rows (out) permuted
    within every 16 to the decode's row / column order (grouped_kernels' docstring)."""
    key = str(device)
    if key not in _HAD:
        from ..synthetic.codebook import hadamard

        b = torch.arange(HAD) % 16
        blk = torch.arange(HAD) - b
        bit = lambda i: (b >> i) & 1
        sigma = blk + bit(1) * 8 + bit(3) * 4 + bit(2) * 2 + bit(0)       # decode row r2 r1 r3 r0 -> true row
        tau = blk + bit(0) * 8 + bit(3) * 4 + bit(2) * 2 + bit(1)         # decode col c2 c1 c0 c3 -> true col
        h = hadamard(HAD)
        _HAD[key] = (h[:, sigma].half().contiguous().to(device), h[tau, :].half().contiguous().to(device))
    return _HAD[key]


@dataclass
class Tables:
    """Pointer tables of one MoE layer's experts (the shared expert, when it fits, as id `experts`)."""

    ptrs: dict[str, torch.Tensor]
    hidden: int
    inter: int
    experts: int
    fmt: tuple[int, int, int]
    rate: float
    shared: bool
    shared_gate: torch.Tensor | None
    keep: list = field(default_factory=list)      # the tensors the pointers point into


def build_tables(layer: MoeLayer, device: torch.device) -> Tables:
    """Tables of a layer whose routed experts share one EXL3 format; ValueError otherwise. The shared expert
    joins when it has that format and width, else it is left to the caller."""
    routed = list(zip(layer.gates, layer.ups, layer.downs))
    f0 = fmt(routed[0][0])
    hidden, inter = layer.hidden, layer.inter
    for g, u, d in routed:
        if {fmt(g), fmt(u), fmt(d)} != {f0}:
            raise ValueError(f"experts mix EXL3 formats: {fmt(g)} {fmt(u)} {fmt(d)} against {f0}")
        dims = (g.in_features, g.out_features, u.out_features, d.in_features, d.out_features)
        if dims != (hidden, inter, inter, inter, hidden):
            raise ValueError("experts differ in shape")
    if hidden % HAD or inter % HAD:
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of {HAD}")
    shared = layer.shared is not None and all(fmt(m) == f0 for m in layer.shared) \
        and layer.shared[0].out_features == inter and layer.shared[2].out_features == hidden
    trip = routed + ([tuple(layer.shared)] if shared else [])
    ptrs, keep = {}, []
    for name, pick, attr in (("g", 0, "trellis"), ("u", 1, "trellis"), ("d", 2, "trellis"), ("g_suh", 0, "suh"),
                             ("u_suh", 1, "suh"), ("g_svh", 0, "svh"), ("u_svh", 1, "svh"), ("d_suh", 2, "suh"),
                             ("d_svh", 2, "svh")):
        ts = [getattr(t[pick], attr) for t in trip]
        keep += ts
        ptrs[name] = torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)
    sg = layer.shared_gate.reshape(-1).half().contiguous().to(device) if shared and layer.shared_gate is not None else None
    return Tables(ptrs, hidden, inter, len(routed), f0, routed[0][0].K, shared, sg, keep)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_WS: dict = {}


def workspace(device: torch.device, total: int, segments: int, hidden: int, inter: int, experts: int) -> dict:
    """Scratch of one call shape, reused by every layer (their launches are ordered on one stream)."""
    key = (str(device), total, segments, hidden, inter, experts)
    if key not in _WS:
        i32, f16 = dict(dtype=torch.int32, device=device), dict(dtype=torch.float16, device=device)
        eb = next_pow2(experts + 1)
        _WS[key] = {"count": torch.empty(eb, **i32), "start": torch.empty(eb, **i32), "tok": torch.empty(total, **i32),
                    "w": torch.empty(total, dtype=torch.float32, device=device), "exp": torch.empty(total, **i32),
                    "slot_of": torch.empty(total, **i32), "seg": torch.empty(3 * segments, **i32),
                    "n_active": torch.empty(1, **i32), "xg": torch.empty((total, hidden), **f16),
                    "xu": torch.empty((total, hidden), **f16), "act": torch.empty((total, inter), **f16),
                    "slots": torch.empty((total, hidden), dtype=torch.float32, device=device)}
    return _WS[key]


def grouped_forward(x: torch.Tensor, sel: torch.Tensor, weights: torch.Tensor, t: Tables,
                    cfg: KernelConfig = KernelConfig()) -> torch.Tensor:
    """The MoE output [R, hidden] fp32 of rows x [R, hidden] (fp16 or fp32) routed to sel [R, k] with routing
    weights [R, k], plus the shared expert when the tables hold it."""
    k = kernels()
    rows, topk = sel.shape
    assert x.shape == (rows, t.hidden) and x.is_contiguous() and weights.shape == sel.shape
    a = rows * topk
    total = a + (rows if t.shared else 0)
    if total > MAX_SORT:
        raise ValueError(f"{total} assignments exceed the sort's {MAX_SORT}")
    segments = min(t.experts, a) + int(t.shared)
    ws = workspace(x.device, total, segments, t.hidden, t.inter, t.experts)
    had_in, had_out = hadamards(x.device)
    p = t.ptrs
    sel, weights = sel.contiguous(), weights.contiguous()
    k.route_kernel[(1,)](sel, weights, ws["tok"], ws["w"], ws["exp"], ws["slot_of"], ws["seg"], ws["n_active"],
                         ws["count"], ws["start"], a, total, segments, E=t.experts, TOPK=topk,
                         BLOCK=next_pow2(total), EB=next_pow2(t.experts + 1))
    k.rotate_kernel[(total,)](x, ws["tok"], ws["exp"], p["g_suh"], p["u_suh"], had_in, ws["xg"], ws["xu"],
                              HID=t.hidden, HB=max(16, next_pow2(t.hidden // HAD)), num_warps=4)
    ka, half, cb = t.fmt
    rg, cg = group_shape(t.rate)
    shape = dict(HID=t.hidden, INT=t.inter, KA=ka, HALF=half, CB=cb, ASM=cfg.use_asm(x.device), RG=rg,
                 CG=cg, BM=cfg.bm, BK=cfg.bk, num_warps=cfg.warps, num_stages=cfg.stages)
    k.gate_up_kernel[(segments, t.inter // HAD)](ws["xg"], ws["xu"], ws["act"], ws["seg"], ws["n_active"], p["g"], p["u"],
                                                 p["g_svh"], p["u_svh"], p["d_suh"], had_in, had_out, segments, **shape)
    k.down_kernel[(segments, t.hidden // HAD)](ws["act"], ws["slots"], ws["w"], ws["seg"], ws["n_active"], p["d"],
                                               p["d_svh"], had_out, segments, **shape)
    out = torch.empty((rows, t.hidden), dtype=torch.float32, device=x.device)
    gated = t.shared_gate is not None
    k.combine_kernel[(rows,)](ws["slots"], ws["slot_of"], x, t.shared_gate if gated else x, out, a, HID=t.hidden,
                              TOPK=topk, SHARED=t.shared, GATED=gated, BH=next_pow2(t.hidden))
    return out
