"""The union MoE forward: the experts a call touches form one dense problem.

A call of R rows routed to k experts each touches U <= min(R*k, E) distinct experts (plus the shared one). Each of
them is decoded once and multiplied with all R rows by a multi-matrix EXL3 GEMM (exllamav3's `exl3_mgemm`, the
same inner kernel as its dense linears): gate and up of every touched expert in one launch, down in another.
The pairs a row did not route to are computed and dropped: at 64 rows or fewer the multiply-adds are free beside
the decode. Three small Triton kernels do the rest on the GPU with no host sync: the union (slots, GEMM indices,
each pick's slot), silu(gate) * up, and each row's weighted sum in routing order plus the (gated) shared expert.
Every shape is fixed by R alone (unused slots carry index -1, which the GEMM skips), so a call can be replayed in
a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .weights import Exl3Weight, MoeLayer

MAX_ROWS = 64               # rows per call the workspace is built for

# exl3_mgemm(A, B, C, suh, A_had, svh, indices, weights, K, force_shape, mcg, mul1, min_index, max_index, force_sms)
Mgemm = Callable[..., object]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class Projection:
    """One EXL3 format's pointer tables over a list of weights (trellis, suh, svh) and its format."""

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    K: float
    mcg: bool
    mul1: bool

    @staticmethod
    def of(linears: list[Exl3Weight], device: torch.device) -> "Projection":
        f0 = fmt(linears[0])
        if any(fmt(m) != f0 for m in linears):
            raise ValueError("the linears of one GEMM mix EXL3 formats")
        ptrs = lambda attr: torch.tensor([getattr(m, attr).data_ptr() for m in linears], dtype=torch.int64, device=device)
        return Projection(ptrs("trellis"), ptrs("suh"), ptrs("svh"), *f0)


def fmt(lin: Exl3Weight) -> tuple[float, bool, bool]:
    """(bits, mcg, mul1) of an EXL3 weight."""
    return float(lin.K), bool(lin.mcg), bool(lin.mul1)


@dataclass
class UnionTables:
    """An MoE layer as two GEMMs: gate+up over [gates, ups] and down over [downs], the shared expert (when its
    formats and width match the routed ones) as the last entry of each list."""

    gate_up: Projection
    down: Projection
    hidden: int
    inter: int
    experts: int
    shared: bool
    shared_gate: torch.Tensor | None
    keep: list[Exl3Weight] = field(default_factory=list)       # the weights the pointers point into


def build_tables(layer: MoeLayer, device: torch.device) -> UnionTables:
    """Tables of a layer (gates, ups, downs, shared, shared_gate); ValueError when its routed experts cannot share
    the two GEMMs."""
    hidden, inter = layer.gates[0].in_features, layer.gates[0].out_features
    for g, u, d in zip(layer.gates, layer.ups, layer.downs):
        if (g.in_features, g.out_features, u.out_features, d.in_features, d.out_features) != (hidden, inter, inter, inter, hidden):
            raise ValueError("experts differ in shape")
    if hidden % 128 or inter % 128:
        raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of 128")
    if fmt(layer.gates[0]) != fmt(layer.ups[0]):
        raise ValueError("gate and up differ in EXL3 format")
    sh = layer.shared
    shared = sh is not None and sh[0].out_features == inter and sh[2].out_features == hidden \
        and fmt(sh[0]) == fmt(sh[1]) == fmt(layer.gates[0]) and fmt(sh[2]) == fmt(layer.downs[0])
    extra = lambda i: [sh[i]] if shared else []
    gu = list(layer.gates) + extra(0) + list(layer.ups) + extra(1)
    dn = list(layer.downs) + extra(2)
    gate = layer.shared_gate.reshape(-1).half().contiguous().to(device) \
        if shared and layer.shared_gate is not None else None
    return UnionTables(Projection.of(gu, device), Projection.of(dn, device), hidden, inter, len(layer.gates), shared,
                       gate, keep=gu + dn)


def kernels():
    """The Triton kernels (imported on first use: importing this module needs no Triton)."""
    from . import union_kernels

    return union_kernels


class Workspace:
    """Scratch of the union forward, sized for the largest call seen and shared by every layer of a model (their
    launches are ordered on one stream)."""

    def __init__(self):
        self.buf: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []     # outgrown buffers stay alive: a captured graph may still use them

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        key = (name, device)
        have = self.buf.get(key)
        if have is None or have.numel() < n or have.dtype != dtype:
            if have is not None:
                self.retired.append(have)
            have = self.buf[key] = torch.empty(n, dtype=dtype, device=device)
        return have[:n].view(shape)


WORKSPACE = Workspace()


def slots(rows: int, topk: int, t: UnionTables) -> int:
    """Slots of a call: every expert its picks could touch, plus the shared one."""
    return min(rows * topk, t.experts) + int(t.shared)


def union_forward(x: torch.Tensor, sel: torch.Tensor, weights: torch.Tensor, t: UnionTables, mgemm: Mgemm,
                  ws: Workspace = WORKSPACE, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE output [R, hidden] fp32 of rows x [R, hidden] routed to sel [R, k] with weights [R, k], plus the
    shared expert when the tables hold it (into `out` when given: a call then allocates nothing once the workspace
    has its size, so it can be captured in a CUDA graph)."""
    k = kernels()
    rows, topk = sel.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{rows} rows: the union path takes 1..{MAX_ROWS}")
    dev, H, I = x.device, t.hidden, t.inter
    u = slots(rows, topk, t)
    x = x.reshape(rows, H).to(torch.float16).contiguous()
    sel, weights = sel.contiguous(), weights.contiguous()
    i32, i64, f16 = torch.int32, torch.int64, torch.float16
    eb = next_pow2(t.experts)
    mark, n_active = ws.get("mark", (eb,), i32, dev), ws.get("n", (1,), i32, dev)
    idx_gu, idx_d = ws.get("idx_gu", (1, 2 * u), i64, dev), ws.get("idx_d", (1, u), i64, dev)
    slot_of = ws.get("slot_of", (rows * topk,), i32, dev)
    k.union_kernel[(1,)](sel, mark, idx_gu, idx_d, slot_of, n_active, rows * topk, E=t.experts, SHARED=int(t.shared),
                         UMAX=u, PB=next_pow2(rows * topk), EB=eb, UB=next_pow2(u))
    gu, p = ws.get("gu", (2 * u, rows, I), f16, dev), t.gate_up
    mgemm(x.view(1, rows, H), p.trellis, gu, p.suh, ws.get("had_gu", (2 * u, rows, H), f16, dev), p.svh, idx_gu, None,
          p.K, -1, p.mcg, p.mul1, -1, -1, 0)
    act = ws.get("act", (u, rows, I), f16, dev)
    k.act_kernel[(u,)](gu, act, n_active, rows, INT=I, BR=min(16, next_pow2(rows)), num_warps=4)
    dn, p = ws.get("dn", (u, rows, H), torch.float32, dev), t.down
    mgemm(act, p.trellis, dn, p.suh, ws.get("had_d", (u, rows, I), f16, dev), p.svh, idx_d, None, p.K, -1, p.mcg,
          p.mul1, -1, -1, 0)
    out = torch.empty((rows, H), dtype=torch.float32, device=dev) if out is None else out
    bh = next(b for b in (512, 256, 128) if H % b == 0)
    gated = t.shared_gate is not None
    k.combine_kernel[(rows, H // bh)](dn, slot_of, weights, x, t.shared_gate if gated else x, out, rows, HID=H,
                                      TOPK=topk, SHARED=int(t.shared), GATED=gated, BH=bh, HB=next_pow2(H))
    return out
