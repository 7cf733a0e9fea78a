"""What the MoE path tests share: Triton kernels imported under TRITON_INTERPRET=1, random routed rows, the
tolerance against the float64 reference, a BlockSparseMLP stand-in and a reference of exllamav3's exl3_mgemm."""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from types import SimpleNamespace

import torch

from toolkit.moe.ref import HAD, inner_weight, codebook_of
from toolkit.synthetic.codebook import hadamard

HID, INT, EXPERTS, TOPK = 256, 128, 8, 2
# (codebook, bits, shared expert, gated shared expert): the formats each path's forward is checked on
FORMATS = [("mul1", 2.5, True, False), ("3inst", 3, False, False), ("mcg", 6, True, True)]


@contextlib.contextmanager
def interpreted(module: str):
    """Import a kernels module under TRITON_INTERPRET=1 (read when a kernel is defined) without leaving it set."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.pop(module, None)
    try:
        yield importlib.import_module(module)
    finally:
        sys.modules.pop(module, None)
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def interpreted_fixture(module: str):
    """A module-scoped, autouse fixture yielding `module` imported under TRITON_INTERPRET=1."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def interpreted_kernels():
        with interpreted(module) as mod:
            yield mod

    return interpreted_kernels


def routed(rows: int, seed: int, experts: int = EXPERTS, topk: int = TOPK):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HID, generator=g).half()
    sel = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(rows)])
    return x, sel, torch.rand(rows, topk, generator=g).half()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (out.double() - ref).abs().max().item()
    assert diff <= 3e-3 * ref.abs().max().item(), f"max abs difference {diff:.3g}, output scale {ref.abs().max():.3g}"


class RefMgemm:
    """exllamav3's exl3_mgemm in torch for the modes the union path uses: slot j multiplies A[0] (one input) or
    A[j] by the linear at table entry indices[0, j] (skipped when negative) into C[j], had(had(a * suh) @ W) *
    svh with the input rotation rounded to fp16 as the kernel's scratch is. `calls` records each call's slots."""

    def __init__(self, linears):
        self.by_ptr = {m.trellis.data_ptr(): m for m in linears}
        self.inner: dict[int, torch.Tensor] = {}
        self.calls: list[int] = []

    def __call__(self, A, B, C, suh, A_had, svh, indices, weights, K, force_shape, mcg, mul1, min_index, max_index,
                 force_sms, *rest):
        assert weights is None and min_index < 0 and not rest and A.dtype == torch.float16 and A.dim() == C.dim() == 3
        assert A_had.numel() >= max(A.shape[0], C.shape[0]) * A.shape[1] * A.shape[2]
        h = hadamard(HAD).double() / math.sqrt(HAD)
        n = min(max(A.shape[0], C.shape[0]), indices.shape[1])
        live = 0
        for j in range(n):
            q = int(indices[0, j])
            if q < 0:
                continue
            lin = self.by_ptr[int(B[q])]
            assert (float(lin.K), bool(lin.mcg), bool(lin.mul1)) == (float(K), bool(mcg), bool(mul1))
            assert int(suh[q]) == lin.suh.data_ptr() and int(svh[q]) == lin.svh.data_ptr()
            w = self.inner.setdefault(int(B[q]), inner_weight(lin.trellis, lin.K, codebook_of(lin)).double())
            a = (A[0] if A.shape[0] == 1 else A[j]).double() * lin.suh.double()
            a = (a.view(-1, HAD) @ h).view(a.shape).half().double()
            y = a @ w
            y = (y.view(-1, HAD) @ h).view(y.shape) * lin.svh.double()
            C[j] = y.to(C.dtype)
            live += 1
        self.calls.append(live)
        return 0


def linear_exl3(w) -> SimpleNamespace:
    """exllamav3's LinearEXL3 as the lever reads it (the attributes seams.INSTANCE_ATTRS declares), over an
    Exl3Weight's tensors: an engine object, not the plain input the MoE paths take."""
    return SimpleNamespace(trellis=w.trellis, suh=w.suh, svh=w.svh, K=w.K, mcg=w.mcg, mul1=w.mul1,
                           in_features=w.in_features, out_features=w.out_features)


class FakeMoE:
    """The BlockSparseMLP attributes the lever reads, over a MoeLayer; its own forward returns a marker."""

    def __init__(self, lay, topk: int = TOPK):
        q = lambda lins: [SimpleNamespace(inner=linear_exl3(m), quant_type="exl3") for m in lins]
        self.gates, self.ups, self.downs = q(lay.gates), q(lay.ups), q(lay.downs)
        sh = lay.shared
        self.shared_experts = None if sh is None else SimpleNamespace(
            gates=q(sh[:1]), ups=q(sh[1:2]), downs=q(sh[2:]), activation_fn="silu")
        self.shared_gate = None if lay.shared_gate is None else SimpleNamespace(
            quant_type="fp16", inner=SimpleNamespace(weight=lay.shared_gate.view(-1, 1)))
        self.hidden_size, self.num_experts, self.num_local_experts = lay.hidden, len(lay.gates), len(lay.gates)
        self.intermediate_size = self.intermediate_size_padded = lay.inter
        self.num_experts_per_tok = topk
        self.bc, self.routing_gate, self.routing_cfg = object(), object(), None
        self.is_quantized = self.support_quant_paths = self.gated = True
        self.activation_fn, self.act_limit, self.interm_div = "silu", 0.0, 1.0
        self.latent_in = self.routed_pre_norm = self.routed_post_norm = self.router_pre_norm = None
        self.routing_device = self.cpu_split_first = self.shared_experts_post_norm = None
        self.alt_residual_channel = self.tp_reduce = self.cpu_offload = False
        self.router = torch.randn(lay.hidden, len(lay.gates), generator=torch.Generator().manual_seed(4))

    def routing_fn(self, bsz, cfg, z, params):
        w, sel = torch.softmax(z.float() @ self.router, -1).topk(self.num_experts_per_tok, -1)
        return sel, w.half()

    def forward(self, x, params, out_dtype=None):
        return "stock"
