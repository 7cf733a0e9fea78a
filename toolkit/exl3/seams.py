"""Every exllamav3 name the toolkit touches, reached through this one module and checked when exllamav3 loads.

The toolkit drives exllamav3's public classes (Config, Model, Cache, Tokenizer, Generator, Job, the samplers)
and, for what exllamav3 does not expose, a few private seams: the Generator's DFlash and MTP drafting steps (the
round capture and the per-round width), its MoE and sliding-attention layers (the levers wrap their forwards), kernels
of its CUDA extension, its vendored gated delta rule (the tap capture) and its converter. `require()` checks
that each seam exists with the parameters the toolkit passes, whatever the version: an exllamav3 whose seams check
out is accepted, and a missing one is one error line naming it. Attributes that exist only on a loaded module
are checked on the first instance (`check_instance`). docs/architecture.md lists the seams and what each is for.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from functools import lru_cache

from ..core.errors import ToolkitError

TESTED = "1.6.5"                   # run on a GPU (1.6.0-1.6.4 fail the seam check: experiments/seam_range.py)
SUPPORTED = ">=1.6.5,<1.7"


@dataclass(frozen=True)
class Seam:
    """One name: where it lives ("module:attr.attr"), what the toolkit uses it for, the parameters a callable
    must take (by name), and whether the toolkit works without it."""

    path: str
    purpose: str
    params: tuple[str, ...] = ()
    optional: bool = False
    key: str = ""

    @property
    def name(self) -> str:
        return self.key or self.path.rpartition(":")[2].rpartition(".")[2]


SEAMS = {s.name: s for s in (
    Seam("exllamav3:Config", "reads a model folder"),
    Seam("exllamav3:Model", "loads the target and the drafter"),
    Seam("exllamav3:Cache", "the paged K/V cache of each model", ("model", "max_num_tokens", "max_batch_size")),
    Seam("exllamav3:Tokenizer", "the target's tokenizer"),
    Seam("exllamav3:Generator", "the engine both decoding modes run on",
         ("model", "cache", "tokenizer", "max_batch_size", "draft_model", "draft_cache", "num_draft_tokens")),
    Seam("exllamav3:Job", "one request", ("input_ids", "max_new_tokens")),
    Seam("exllamav3:Generator.iterate_draftmodel_dflash_gen",
         "the DFlash drafting step: the round capture copies its block and the policy sets its window",
         ("results", "window")),
    Seam("exllamav3:Generator.iterate_draftmodel_mtp_gen",
         "the target's own MTP head drafting (--draft mtp): the round capture copies its drafts", ("results", "window"),
         optional=True),
    Seam("exllamav3.generator.sampler:ArgmaxSampler", "greedy decoding"),
    Seam("exllamav3.generator.sampler:CategoricalSampler", "sampling at a temperature", ("temperature",)),
    Seam("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "the MoE layer the MoE levers wrap"),
    Seam("exllamav3.modules.block_sparse_mlp:BlockSparseMLP.forward", "the forward the MoE levers stand in for",
         ("x", "params", "out_dtype"), key="BlockSparseMLP.forward"),
    Seam("exllamav3.modules.sliding_attn:SlidingAttention", "the drafter's window layers graph_draft_swa wraps"),
    Seam("exllamav3.modules.sliding_attn:SlidingAttention.forward", "the forward graph_draft_swa calls",
         ("x", "params", "out_dtype"), key="SlidingAttention.forward"),
    Seam("exllamav3.modules:Embedding", "the target's embedding table, read by the tap capture"),
    Seam("exllamav3:Model.forward_ls", "the layer walk forward_graphs replays from one CUDA graph", ("x", "params"),
         key="Model.forward_ls"),
    Seam("exllamav3.util.tensor:get_for_device", "a call's tables on the device, copied into forward_graphs' inputs",
         ("input_dict", "key", "device")),
    Seam("exllamav3.modules:Linear", "the drafter's linears, dequantized by the quantize check"),
    Seam("exllamav3.ext:exllamav3_ext.exl3_mgemm", "the multi-matrix EXL3 GEMM of the union MoE path",
         ("A", "B", "C", "suh", "A_had", "svh", "indices", "weights", "K", "force_shape_idx", "mcg", "mul1",
          "min_index", "max_index", "force_num_sms")),
    Seam("exllamav3.ext:exllamav3_ext.add_sigmoid_gate", "a shared expert's gate the MoE paths leave to exllamav3"),
    Seam("exllamav3.ext:exllamav3_ext.add_sigmoid_gate_proj", "the same, for up to 32 rows"),
    Seam("exllamav3.vendor.fla:chunk_gated_delta_rule", "the linear-attention scan the tap capture hands a state",
         ("q", "k", "v"), optional=True),
    Seam("exllamav3.conversion.convert_model:main", "the EXL3 converter the quantize pipeline runs", optional=True,
         key="convert_model"),
)}

# attributes of live objects the toolkit reads, checked on the first instance it meets
INSTANCE_ATTRS = {
    "Generator": ("active_jobs", "draft_model", "num_draft_tokens"),
    "Job": ("sequences", "draft_stats"),
    "BlockSparseMLP": ("gates", "ups", "downs", "num_experts", "num_experts_per_tok", "hidden_size", "routing_fn",
                       "routing_cfg", "shared_experts", "shared_gate", "activation_fn"),
    "SlidingAttention": ("window_right", "sliding_window"),
    "Model": ("fwd_modules",),
}
CONVERTER = SEAMS["convert_model"].path.partition(":")[0]


def version() -> str | None:
    """The installed exllamav3 version, or None when it is not installed (does not import it)."""
    from importlib import metadata

    try:
        return metadata.version("exllamav3")
    except metadata.PackageNotFoundError:
        return None


def resolve(seam: Seam):
    """The object a seam names (ImportError / AttributeError when it is not there)."""
    module, _, attrs = seam.path.partition(":")
    obj = importlib.import_module(module)
    for a in attrs.split("."):
        obj = getattr(obj, a)
    return obj


def problem(seam: Seam) -> str | None:
    """What is wrong with one seam in the exllamav3 installed (None: it checks out)."""
    try:
        obj = resolve(seam)
    except (ImportError, AttributeError) as e:
        return f"{seam.path} is missing ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not seam.params:
        return None
    try:
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    except (TypeError, ValueError):                       # a compiled function: its signature line, when it has one
        names = compiled_params(obj)
        if names is None:
            return None
        if names[:len(seam.params)] != list(seam.params):  # the toolkit passes these by position
            return f"{seam.path} has changed: it takes ({', '.join(names)}), the toolkit passes ({', '.join(seam.params)})"
        return None
    names = set(sig.parameters)
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    lacking = [p for p in seam.params if p not in names]
    return f"{seam.path} has changed: it takes no {lacking[0]!r}" if lacking else None


def compiled_params(fn) -> list[str] | None:
    """A compiled (pybind11) function's parameter names from its signature line `name(a: T, b: T = x) -> R`, or
    None when its docstring carries none (several overloads or no signature)."""
    line = (getattr(fn, "__doc__", None) or "").strip().splitlines()[:1]
    name = getattr(fn, "__name__", "")
    if not line or not line[0].startswith(f"{name}(") or ")" not in line[0]:
        return None
    inner, depth, parts, cur = line[0][len(name) + 1:line[0].rindex(")")], 0, [], ""
    for ch in inner:                                       # split on top-level commas (types may hold brackets)
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.split(":")[0].split("=")[0].strip() for p in parts if p.strip()]


def installed() -> str:
    """The installed exllamav3's version, without importing it; one-line ToolkitError when there is none."""
    v = version()
    if v is None:
        raise ToolkitError("exllamav3 is not installed: install the gpu extra, pip install 'dflash-exl3-toolkit[gpu]' "
                           f"(exllamav3{SUPPORTED}, needs a CUDA build of torch)")
    return v


@lru_cache(maxsize=1)
def require() -> None:
    """Import exllamav3 and check every required seam, once per process; one-line ToolkitError naming the first
    that fails."""
    v = installed()
    try:
        importlib.import_module("exllamav3")
    except ImportError as e:
        raise ToolkitError(f"exllamav3 {v} is installed but does not import ({str(e).splitlines()[0]})") from None
    for seam in SEAMS.values():
        why = None if seam.optional else problem(seam)
        if why:
            raise ToolkitError(f"exllamav3 {v} does not fit this toolkit: {why}; it needs it for {seam.purpose} "
                               f"(tested with exllamav3 {TESTED})")


def get(name: str):
    """The exllamav3 object of a seam, after require(); an optional seam that is missing gives None."""
    seam = SEAMS[name]
    try:
        return resolve(seam)
    except (ImportError, AttributeError):
        if seam.optional:
            return None
        raise ToolkitError(f"exllamav3 {version()}: {seam.path} is missing; it is needed for {seam.purpose}") from None


def check_instance(kind: str, obj) -> None:
    """One-line ToolkitError when a live exllamav3 object lacks an attribute the toolkit reads."""
    lacking = [a for a in INSTANCE_ATTRS[kind] if not hasattr(obj, a)]
    if lacking:
        raise ToolkitError(f"exllamav3 {version()}: a {kind} has no {lacking[0]!r} (tested with exllamav3 {TESTED})")
