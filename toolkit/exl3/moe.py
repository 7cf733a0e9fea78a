"""The MoE levers on exllamav3's EXL3 MoE layers (BlockSparseMLP): one forward wrap that sends each call to the
path that wins at its row count, and exllamav3's own forward everywhere else.

- `union_moe` (toolkit/moe/union.py): the distinct experts a call touches, each decoded once for all of its rows
  by exllamav3's multi-matrix EXL3 GEMM, with the union, activation and weighted sum in small Triton kernels and
  no host sync;
- `packed_moe` (toolkit/moe/packed.py): each touched expert decoded once per 8 of its own rows by the same GEMM,
  its rows packed into slots on the GPU;
- `grouped_moe` (toolkit/moe/grouped.py): the call's picks sorted by expert, each expert's weights decoded by our
  Triton kernels once per block of its own rows.

The wrap falls back to exllamav3's forward outside each path's rows and wherever the layer has something neither
path implements (see `applies`); `path_counts` says how many calls took which path. The paths never see an
exllamav3 object: `module_layer` hands them the layer's tensors and formats (toolkit/moe/weights.py).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from ..moe.weights import Exl3Weight, MoeLayer
from . import seams
from .draft_levers import set_forward_wrap

# Rows per call each path takes (inclusive); the first path on, in PATHS order, wins. Union and grouped, H100, whole
# model: c=1 w=7 round 15.8 -> 12.3 ms, c=8 AR step 13.5 -> 10.1, c=1 AR step 6.56 -> 6.31 (1 row); one layer:
# union / stock 0.93 at 4 rows, 0.71 at 8; union / grouped 0.65 at 16, 1.04 at 32. Packed: not timed yet.
ROWS = {"union": (1, 16), "packed": (17, 512), "grouped": (9, 64)}
GRAPH_UNION = True                 # replay the union and packed paths from a CUDA graph per (layer, rows)
PATHS = ("union", "packed", "grouped")
GRAPHED = ("union", "packed")
UNSAFE_PARAMS = ("autosplit_measure", "capture_sens", "capture_qmaps", "activate_all_experts", "tp_warmup",
                 "capture", "quant_preserve", "ovr", "reconstruct")      # calibration, conversion, overrides


# -- the lever on exllamav3's BlockSparseMLP --------------------------------------------------------------------


def applies(module, params: dict) -> bool:
    """Whether a BlockSparseMLP call is one the MoE paths compute as exllamav3 would: EXL3 experts with a silu gate
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


def exl3_weight(lin) -> Exl3Weight:
    """An exllamav3 LinearEXL3's tensors and format, as the MoE paths take them (the tensors themselves, not
    copies: the paths' tables point into them)."""
    return Exl3Weight(lin.trellis, lin.suh, lin.svh, lin.K, bool(lin.mcg), bool(lin.mul1), int(lin.in_features),
                      int(lin.out_features))


def module_layer(module) -> MoeLayer:
    """A BlockSparseMLP's EXL3 weights as a MoeLayer of plain tensors (the shared expert only when it is one EXL3
    GatedMLP slice with a silu gate and an fp16 sigmoid gate or none)."""
    inner = lambda ls: [exl3_weight(m.inner) for m in ls]
    shared = sgate = None
    se = getattr(module, "shared_experts", None)
    if se is not None and len(getattr(se, "gates", [])) == 1 and getattr(se, "activation_fn", None) == "silu" \
            and all(getattr(m[0], "quant_type", None) == "exl3" for m in (se.gates, se.ups, se.downs)):
        sg = getattr(module, "shared_gate", None)
        if sg is None or (getattr(sg, "quant_type", None) == "fp16" and sg.inner.weight.numel() == module.hidden_size):
            shared = (exl3_weight(se.gates[0].inner), exl3_weight(se.ups[0].inner), exl3_weight(se.downs[0].inner))
            sgate = None if sg is None else sg.inner.weight
    return MoeLayer(inner(module.gates), inner(module.ups), inner(module.downs), shared, sgate)


def add_shared_stock(module, x: torch.Tensor, params: dict, out: torch.Tensor) -> None:
    """The shared expert the tables could not take, as exllamav3's forward adds it (into `out`, fp32)."""
    y = module.shared_experts.forward(x, params)
    if module.shared_gate is None:
        out += y.view(out.shape)
    elif out.shape[0] > 32:
        seams.get("add_sigmoid_gate")(y, module.shared_gate.forward(x, params), out)
    else:
        seams.get("add_sigmoid_gate_proj")(y, x, out, module.shared_gate.inner.weight)


class MoeForward:
    """A BlockSparseMLP's forward that runs each call through the first path that is on and takes its row count
    (`ROWS`), else through exllamav3's own; `calls` counts the paths taken."""

    def __init__(self, module):
        self.module = module
        self.inner = type(module).forward.__get__(module)      # the class's own forward, bound
        self.on: dict[str, bool] = {p: False for p in PATHS}
        self.calls = {**{p: 0 for p in PATHS}, "stock": 0}
        self.tables: dict[str, object] = {}
        self.key = None
        self.unfit: dict[str, str] = {}
        self.mgemm = None                                      # exllamav3's exl3_mgemm unless a test sets one
        self.graphed: dict = {}                                # path -> its graphs (moe/graphs.py), per tables
        self.graph_union = GRAPH_UNION

    def current_tables(self, path: str):
        """The layer's tables for `path`, rebuilt when its tensors moved; None when its formats do not fit."""
        lin = self.module.gates[0].inner
        key = (lin.trellis.data_ptr(), str(lin.trellis.device))
        if key != self.key:
            self.key, self.tables, self.unfit, self.graphed = key, {}, {}, {}
        if path not in self.tables and path not in self.unfit:
            try:
                self.tables[path] = build(path, module_layer(self.module), lin.trellis.device)
            except ValueError as e:
                self.unfit[path] = str(e)
        return self.tables.get(path)

    def pick(self, rows: int, params: dict) -> str:
        if not applies(self.module, params):
            return "stock"
        for p in PATHS:
            if self.on[p] and ROWS[p][0] <= rows <= ROWS[p][1] and self.current_tables(p) is not None:
                return p
        return "stock"

    def __call__(self, x, params: dict, out_dtype=None):
        m = self.module
        rows = x.numel() // x.shape[-1]
        path = self.pick(rows, params)
        if path == "stock":
            self.calls["stock"] += 1
            return self.inner(x, params, out_dtype)
        y = x.view(rows, x.shape[-1])
        z = m.router_pre_norm.forward(y, params, out_dtype=torch.half) if getattr(m, "router_pre_norm", None) else y
        sel, w = m.routing_fn(rows, m.routing_cfg, z, params)
        tables = self.tables[path]
        try:
            out = self.run(path, y.contiguous(), sel, w, tables)
        except Exception as e:              # a kernel that does not build here: this path is off from now on
            self.unfit[path] = f"{type(e).__name__}: {e}"[:500]
            self.tables.pop(path, None)
            warnings.warn(f"{path} MoE path off for {getattr(m, 'key', 'a layer')}: {self.unfit[path]}")
            self.calls["stock"] += 1
            return self.inner(x, params, out_dtype)
        self.calls[path] += 1
        if m.shared_experts is not None and not tables.shared:
            add_shared_stock(m, x, params, out)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if out_dtype is None else out.to(out_dtype)

    def run(self, path: str, y: torch.Tensor, sel: torch.Tensor, w: torch.Tensor, tables) -> torch.Tensor:
        if path in GRAPHED:
            if path == "union":
                from ..moe.union import union_forward as forward
            else:
                from ..moe.packed import packed_forward as forward

            if self.mgemm is None:
                self.mgemm = seams.get("exl3_mgemm")
            if not (self.graph_union and y.is_cuda):
                return forward(y, sel, w, tables, self.mgemm)
            if path not in self.graphed:
                from ..moe.graphs import Graphed

                mgemm = self.mgemm
                self.graphed[path] = Graphed(lambda a, s, v, out=None: forward(a, s, v, tables, mgemm, out=out))
            return self.graphed[path](y, sel, w)
        from ..moe.grouped import MAX_SORT, grouped_forward

        if sel.numel() + sel.shape[0] > MAX_SORT:
            raise ValueError(f"{sel.numel()} picks exceed the sort's {MAX_SORT}")
        return grouped_forward(y, sel, w, tables)


def build(path: str, layer: MoeLayer, device: torch.device):
    """A layer's tables for one path (ValueError when its formats do not fit that path)."""
    if path in GRAPHED:                      # the packed path reads the union path's tables
        from ..moe.union import build_tables
    else:
        from ..moe.grouped import build_tables
    return build_tables(layer, device)


def missing() -> str | None:
    """Why the MoE paths cannot run here (None when they can): Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def install(model, moe_class: type, options):
    """Put the MoE wrap on every `moe_class` module with the paths `options` turns on (off when none is); the
    options in force come back, with the MoE levers off where they cannot run (one warning says why)."""
    wanted = {p: bool(getattr(options, f"{p}_moe")) for p in PATHS}
    if any(wanted.values()) and (why := missing()):
        warnings.warn(f"{', '.join(f'{p}_moe' for p in PATHS if wanted[p])} off: {why}")
        options = replace(options, **{f"{p}_moe": False for p in PATHS})
        wanted = {p: False for p in PATHS}
    set_paths(model, moe_class, wanted)
    return options


def set_paths(model, moe_class: type, on: dict[str, bool]) -> int:
    """Install the wrap with these paths on (or remove it when none is) on every `moe_class` module of `model`;
    returns how many."""
    n = set_forward_wrap(model, moe_class, MoeForward, any(on.values()))
    for m in model:
        wrap = vars(m).get("forward") if isinstance(m, moe_class) else None
        if isinstance(wrap, MoeForward):
            wrap.on.update(on)
    return n


STOCK_CAPTURABLE = 8     # rows up to which exllamav3's own MoE forward runs with no host sync (it graphs them itself)


def capture_refusal(model, moe_class: type):
    """`refuse(x, params)` for the whole-forward graphs: why a call of that many rows cannot be captured, because
    an MoE layer would take exllamav3's own forward above `STOCK_CAPTURABLE` rows, which reads its expert counts
    back to the host; None when every layer takes a path with no host sync."""
    layers = [m for m in model if isinstance(m, moe_class)]

    def refuse(x, params: dict) -> str | None:
        rows = x.numel() // x.shape[-1] if x.dim() > 2 else x.numel()
        if rows <= STOCK_CAPTURABLE:
            return None
        for m in layers:
            wrap = vars(m).get("forward")
            if not isinstance(wrap, MoeForward) or wrap.pick(rows, params) == "stock":
                return f"{rows} rows take exllamav3's own MoE forward, which syncs with the host"
        return None

    return refuse


def path_counts(model, moe_class: type) -> dict[str, int]:
    """Calls per path summed over the model's wrapped MoE layers: {"union": n, "packed": p, "grouped": m,
    "stock": k}."""
    total = {**{p: 0 for p in PATHS}, "stock": 0}
    for m in model:
        wrap = vars(m).get("forward") if isinstance(m, moe_class) else None
        if isinstance(wrap, MoeForward):
            for k, v in wrap.calls.items():
                total[k] += v
    return total
