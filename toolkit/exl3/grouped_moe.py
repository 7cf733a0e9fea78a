"""`grouped_moe`: an expert-grouped forward of exllamav3's EXL3 MoE layers (BlockSparseMLP) for verify rounds.

exllamav3 1.6.5 runs up to 8 rows through its fused decode kernels and more through its generic MoE kernel; at
8..64 rows both run several times slower than the bytes of the distinct experts take to read. This path sorts
a round's (row, expert) picks by expert and runs five Triton launches per layer: the sort, the input rotation,
gate+up (each touched expert's weights decoded once per block of up to `bm` rows, shared by all its rows),
down, and a fixed-order sum per token. The shared expert rides along as one more expert when its format
matches the routed ones. The decode is exllamav3's own arithmetic (grouped_moe_ref.py states the format), so the
weights multiplied are bit-identical to exllamav3's dequantisation; the rest agrees to fp16 rounding.

The wrap falls back to exllamav3's own forward outside `GROUPED_ROWS` and wherever the layer has something this
path does not implement (see `applies`); `path_counts` says how many calls took which path.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch

from .draft_levers import set_forward_wrap
from .grouped_moe_ref import CODEBOOK_IDS, HAD, MoeLayer, codebook_of, split_rate

GROUPED_ROWS = (9, 64)          # rows per call that take the grouped path (inclusive): stock wins up to 8
MAX_SORT = 4096                 # assignments the one-program sort takes
UNSAFE_PARAMS = ("autosplit_measure", "capture_sens", "capture_qmaps", "activate_all_experts", "tp_warmup",
                 "capture", "quant_preserve", "ovr", "reconstruct")      # calibration, conversion, overrides


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
    from . import grouped_moe_kernels

    return grouped_moe_kernels


def group_shape(K: float) -> tuple[int, int]:
    """(RG, CG): rows and columns of a decode group, G = RG * CG consecutive positions whose windows lie in two
    consecutive 32-bit words (8 up to 4 bits, 2 at 7 bits, 4 otherwise and at the half rates)."""
    ka, half = split_rate(K)
    if half or ka in (5, 6, 8):
        return 4, 1
    return (2, 1) if ka == 7 else (4, 2)


def fmt(lin) -> tuple[int, int, int]:
    """(KA, HALF, codebook id) of a LinearEXL3-like object."""
    ka, half = split_rate(lin.K)
    return ka, half, CODEBOOK_IDS[codebook_of(lin)]


def decode_inner(lin, asm: bool | None = None) -> torch.Tensor:
    """The rotated-basis weight (in, out) fp16 of an EXL3 linear, decoded by the grouped path's decode."""
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
    within every 16 to the decode's row / column order (grouped_moe_kernels' docstring)."""
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


# -- the lever on exllamav3's BlockSparseMLP --------------------------------------------------------------------


def applies(module, params: dict) -> bool:
    """Whether a BlockSparseMLP call is one this path computes as exllamav3 would: EXL3 experts with a silu gate
    and no biases, the layer whole on one device (no tensor-parallel, CPU or routing-device split), routing that
    reads only the rows, no latent projection, no extra norms around the experts, no calibration pass."""
    g = lambda name, default=None: getattr(module, name, default)
    return (g("bc") is not None and bool(g("is_quantized")) and bool(g("support_quant_paths"))
            and bool(g("gated")) and g("activation_fn") == "silu" and not g("act_limit", 0.0)
            and g("interm_div", 1.0) == 1.0 and g("latent_in") is None and g("routed_pre_norm") is None
            and g("routed_post_norm") is None and g("routing_gate") is not None and not g("alt_residual_channel")
            and not g("tp_reduce") and g("routing_device") is None and g("cpu_split_first") is None
            and not g("cpu_offload") and "hash" not in getattr(g("routing_fn"), "__name__", "")
            and g("num_local_experts") == g("num_experts")
            and g("intermediate_size") == g("intermediate_size_padded")
            and (g("shared_experts") is None or g("shared_experts_post_norm") is None)
            and not any(k in params for k in UNSAFE_PARAMS))


def module_layer(module) -> MoeLayer:
    """A BlockSparseMLP's EXL3 weights as a MoeLayer (the shared expert only when it is one EXL3 GatedMLP slice
    with a silu gate and an fp16 sigmoid gate or none)."""
    inner = lambda ls: [m.inner for m in ls]
    shared = sgate = None
    se = getattr(module, "shared_experts", None)
    if se is not None and len(getattr(se, "gates", [])) == 1 and getattr(se, "activation_fn", None) == "silu" \
            and all(getattr(m[0], "quant_type", None) == "exl3" for m in (se.gates, se.ups, se.downs)):
        sg = getattr(module, "shared_gate", None)
        if sg is None or (getattr(sg, "quant_type", None) == "fp16" and sg.inner.weight.numel() == module.hidden_size):
            shared = (se.gates[0].inner, se.ups[0].inner, se.downs[0].inner)
            sgate = None if sg is None else sg.inner.weight
    return MoeLayer(inner(module.gates), inner(module.ups), inner(module.downs), shared, sgate)


def add_shared_stock(module, x: torch.Tensor, params: dict, out: torch.Tensor) -> None:
    """The shared expert the tables could not take, as exllamav3's forward adds it (into `out`, fp32)."""
    from exllamav3.ext import exllamav3_ext as ext

    y = module.shared_experts.forward(x, params)
    if module.shared_gate is None:
        out += y.view(out.shape)
    elif out.shape[0] > 32:
        ext.add_sigmoid_gate(y, module.shared_gate.forward(x, params), out)
    else:
        ext.add_sigmoid_gate_proj(y, x, out, module.shared_gate.inner.weight)


class GroupedForward:
    """A BlockSparseMLP's forward that runs GROUPED_ROWS rows through grouped_forward and everything else through
    exllamav3's own; `calls` counts the paths taken."""

    def __init__(self, module):
        self.module = module
        self.inner = type(module).forward.__get__(module)      # the class's own forward, bound
        self.rows = GROUPED_ROWS
        self.config = KernelConfig()
        self.calls = {"grouped": 0, "stock": 0}
        self.tables: Tables | None = None
        self.key = None
        self.unfit: str | None = None

    def current_tables(self) -> Tables | None:
        """The layer's tables, rebuilt when its tensors moved; None when its formats do not fit."""
        lin = self.module.gates[0].inner
        key = (lin.trellis.data_ptr(), str(lin.trellis.device))
        if key != self.key:
            self.key, self.tables, self.unfit = key, None, None
            try:
                self.tables = build_tables(module_layer(self.module), lin.trellis.device)
            except ValueError as e:
                self.unfit = str(e)
        return self.tables

    def __call__(self, x, params: dict, out_dtype=None):
        m = self.module
        rows = x.numel() // x.shape[-1]
        if not (self.rows[0] <= rows <= self.rows[1] and applies(m, params)) or self.current_tables() is None \
                or rows * m.num_experts_per_tok + rows > MAX_SORT:
            self.calls["stock"] += 1
            return self.inner(x, params, out_dtype)
        y = x.view(rows, x.shape[-1])
        z = m.router_pre_norm.forward(y, params, out_dtype=torch.half) if getattr(m, "router_pre_norm", None) else y
        sel, w = m.routing_fn(rows, m.routing_cfg, z, params)
        try:
            out = grouped_forward(y.contiguous(), sel, w, self.tables, self.config)
        except Exception as e:              # a kernel that does not build here: exllamav3's path from now on
            self.unfit = f"{type(e).__name__}: {e}"[:500]
            self.tables = None
            warnings.warn(f"grouped MoE path off for {getattr(m, 'key', 'a layer')}: {self.unfit}")
            self.calls["stock"] += 1
            return self.inner(x, params, out_dtype)
        self.calls["grouped"] += 1
        if m.shared_experts is not None and not self.tables.shared:
            add_shared_stock(m, x, params, out)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if out_dtype is None else out.to(out_dtype)


def missing() -> str | None:
    """Why this path cannot run here (None when it can): Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def install(model, moe_class: type, options):
    """Put the grouped forward on (or take it off) every `moe_class` module as `options.grouped_moe` says; the
    options in force come back, with grouped_moe off where this path cannot run (one warning says why)."""
    if options.grouped_moe and (why := missing()):
        warnings.warn(f"grouped_moe stays off: {why}")
        options = replace(options, grouped_moe=False)
    set_grouped_moe(model, moe_class, options.grouped_moe)
    return options


def set_grouped_moe(model, moe_class: type, on: bool) -> int:
    """Install (on) or remove the grouped forward on every `moe_class` module of `model`; returns how many."""
    return set_forward_wrap(model, moe_class, GroupedForward, on)


def path_counts(model, moe_class: type) -> dict[str, int]:
    """Calls per path summed over the model's wrapped MoE layers: {"grouped": n, "stock": m}."""
    total = {"grouped": 0, "stock": 0}
    for m in model:
        wrap = vars(m).get("forward") if isinstance(m, moe_class) else None
        if isinstance(wrap, GroupedForward):
            for k, v in wrap.calls.items():
                total[k] += v
    return total
