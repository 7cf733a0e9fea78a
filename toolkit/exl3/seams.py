"""Every exllamav3 name the toolkit touches, reached through this one module and checked when exllamav3 loads.

The toolkit drives exllamav3's public classes (Config, Model, Cache, Tokenizer, Generator, Job, the samplers)
and, for what exllamav3 does not expose, a few private seams: the Generator's DFlash and MTP drafting steps (the round
capture and the per-round width), its MoE and sliding-attention layers (the levers wrap their forwards), the
layer walk and the window layers' ring preparation (whole-forward graphs), kernels of its CUDA extension, its
vendored gated delta rule (the tap capture) and its converter. `require()` checks that each seam exists with the
parameters the toolkit passes, whatever the version: an exllamav3 whose seams check out is accepted, and a missing
one is one error line naming it. The attributes the toolkit reads on live objects (`INSTANCE_ATTRS`) are checked
on every loaded model, its cache and the first module of each kind in it (`check_loaded`), and on the first
Generator and Job the backend builds. No other module imports exllamav3: they ask `get(name)` for what they use.
docs/architecture.md lists the seams and what each is for.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from ..core.errors import ToolkitError

TESTED = "1.6.5"                   # run on a GPU (1.6.0-1.6.4 fail the seam check: experiments/seam_range.py)
SUPPORTED = ">=1.6.5,<1.7"


@dataclass(frozen=True)
class Seam:
    """One name: where it lives ("module:attr.attr"), what the toolkit uses it for, the parameters a callable
    must take (by name), and whether the toolkit works without it. It is known by `key`, else by its last part,
    with its class in front for a class's member ("Generator.iterate", "exl3_mgemm")."""

    path: str
    purpose: str
    params: tuple[str, ...] = ()
    optional: bool = False
    key: str = ""

    @property
    def name(self) -> str:
        if self.key:
            return self.key
        *owner, attr = self.path.rpartition(":")[2].split(".")
        return f"{owner[-1]}.{attr}" if owner and owner[-1][:1].isupper() else attr


SEAMS = {s.name: s for s in (
    # -- loading and decoding: the public classes and what the backend calls on them
    Seam("exllamav3:Config", "reads a model folder"),
    Seam("exllamav3:Config.from_directory", "a model folder's config", ("directory",)),
    Seam("exllamav3:Model", "loads the target and the drafter"),
    Seam("exllamav3:Model.from_config", "a model from its config", ("config",)),
    Seam("exllamav3:Model.load", "places a model on its GPUs"),
    Seam("exllamav3:Model.load_gen", "the load arguments Model.load passes on",
         ("device", "progressbar", "max_chunk_size", "reserve_per_device", "use_per_device", "tensor_p",
          "draft_model")),
    Seam("exllamav3:Model.unload", "frees a model's GPU memory (close, drafter swap)"),
    Seam("exllamav3:Model.forward", "the tap capture's no-cache forward", ("input_ids", "params")),
    Seam("exllamav3:Cache", "the paged K/V cache of each model",
         ("model", "max_num_tokens", "max_batch_size", "max_history")),
    Seam("exllamav3:Cache.get_all_recurrent_layers", "the recurrent states forward_graphs restores after a replay"),
    Seam("exllamav3:Tokenizer", "the target's tokenizer"),
    Seam("exllamav3:Tokenizer.from_config", "the target's tokenizer from its config", ("config",)),
    Seam("exllamav3:Generator", "the engine both decoding modes run on",
         ("model", "cache", "tokenizer", "max_batch_size", "draft_model", "draft_cache", "num_draft_tokens",
          "record_draft_stats", "max_chunk_size")),
    Seam("exllamav3:Generator.iterate", "one round of every job; the round capture times it"),
    Seam("exllamav3:Generator.iterate_draftmodel_dflash_gen",
         "the DFlash drafting step: the round capture copies its block and the policy sets its window",
         ("results", "window")),
    Seam("exllamav3:Generator.enqueue", "queues a request's jobs", ("job",)),
    Seam("exllamav3:Generator.num_remaining_jobs", "whether a request is done"),
    Seam("exllamav3:Generator.clear_queue", "frees the pages of jobs a consumer stopped reading"),
    Seam("exllamav3:Generator.close", "retires a Generator before another takes its cache"),
    Seam("exllamav3:Job", "one request",
         ("input_ids", "max_new_tokens", "sampler", "seed", "stop_conditions", "identifier")),
    Seam("exllamav3:Job.is_prefill_done", "which jobs a drafted block's rows belong to"),
    Seam("exllamav3.generator.pagetable:Sequence", "a job's token ids, read after every round"),
    Seam("exllamav3.util.tensor:SeqTensor.torch_slice", "the ids a job emitted in a round", ("a", "b")),
    Seam("exllamav3:Generator.iterate_draftmodel_mtp_gen",
         "the target's own MTP head drafting (--draft mtp): the round capture copies its drafts", ("results", "window"),
         optional=True),
    Seam("exllamav3.generator.sampler:ArgmaxSampler", "greedy decoding"),
    Seam("exllamav3.generator.sampler:CategoricalSampler", "sampling at a temperature", ("temperature",)),
    # -- modules: the levers wrap some, forward_graphs walks them, the tap capture and the quantize check read them
    Seam("exllamav3.modules:Module", "every layer forward_graphs walks"),
    Seam("exllamav3.modules:Module.forward", "a layer's forward: the host-side layers forward_graphs runs eagerly, "
         "a shared expert and its gate the MoE paths leave to exllamav3", ("x", "params")),
    Seam("exllamav3.modules:Module.prepare_for_device", "the host-side layers forward_graphs runs eagerly",
         ("x", "params")),
    Seam("exllamav3.modules:Linear", "the drafter's linears, dequantized by the quantize check; the MoE experts"),
    Seam("exllamav3.modules.quant:LinearEXL3", "an EXL3 linear's tensors, which the MoE paths decode"),
    Seam("exllamav3.modules.quant:LinearEXL3.forward", "the LM head the tap capture reads row by row",
         ("x", "params", "out_dtype")),
    Seam("exllamav3.modules.quant:LinearEXL3.get_weight_tensor", "an EXL3 linear dequantized by the quantize check"),
    Seam("exllamav3.modules.quant:LinearFP16", "a shared expert's gate vector; a 16-bit LM head"),
    Seam("exllamav3.modules.quant:LinearFP16.forward", "a 16-bit LM head the tap capture reads row by row",
         ("x", "params", "out_dtype")),
    Seam("exllamav3.modules.quant:LinearFP16.get_weight_tensor", "a 16-bit linear read by the quantize check"),
    Seam("exllamav3.modules:GatedMLP", "a shared expert the MoE paths take into their tables"),
    Seam("exllamav3.modules.block_sparse_mlp:BlockSparseMLP", "the MoE layer the MoE levers wrap"),
    Seam("exllamav3.modules.block_sparse_mlp:BlockSparseMLP.forward", "the forward the MoE levers stand in for",
         ("x", "params", "out_dtype")),
    Seam("exllamav3.modules.sliding_attn:SlidingAttention", "the drafter's window layers graph_draft_swa wraps"),
    Seam("exllamav3.modules.sliding_attn:SlidingAttention.forward", "the forward graph_draft_swa calls",
         ("x", "params", "out_dtype")),
    Seam("exllamav3.modules.sliding_attn:SlidingAttention._decode_state_prep",
         "a window layer's host-side ring preparation, rerun before each forward_graphs replay",
         ("rsg", "k_states", "v_states", "seqlen")),
    Seam("exllamav3.modules:SWAState", "a window layer's state, which forward_graphs lets into a graph"),
    Seam("exllamav3.modules:GDNState", "a gated delta layer's state, which forward_graphs lets into a graph"),
    Seam("exllamav3.modules:Embedding", "the target's embedding table, read by the tap capture"),
    Seam("exllamav3.modules:Embedding.forward", "the embedding lookup the tap capture reads the table through",
         ("x", "params")),
    Seam("exllamav3.modules.arch_specific.dflash:DFlashInputLayer",
         "the drafter's input layer, which forward_graphs runs eagerly", optional=True),
    Seam("exllamav3:Model.forward_ls", "the layer walk forward_graphs replays from one CUDA graph", ("x", "params")),
    Seam("exllamav3.util.tensor:get_for_device", "a call's tables on the device, copied into forward_graphs' inputs",
         ("input_dict", "key", "device")),
    # -- kernels, the vendored scan and the converter
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

# Attributes of live objects the toolkit reads or sets, per class seam: `check_loaded` checks a loaded model, its
# cache and the first module of each kind in it; the backend checks each Generator it builds (and the cache it took
# over) and the first Job of each request. tests/test_exl3_seams.py holds the toolkit's reads to this table.
INSTANCE_ATTRS = {
    "Generator": ("active_jobs", "draft_model", "num_draft_tokens", "cache_owner_serial"),
    "Job": ("sequences", "draft_stats"),
    "Sequence": ("sequence_ids",),
    "Cache": ("max_num_tokens", "owner_serial"),
    "Config": ("vocab_size", "hidden_size"),
    "Model": ("config", "modules", "fwd_modules", "logit_layer_idx"),
    "Module": ("key", "device", "caps", "modules"),
    "Linear": ("inner", "quant_type"),
    "LinearEXL3": ("trellis", "suh", "svh", "K", "mcg", "mul1", "in_features", "out_features"),
    "LinearFP16": ("weight", "in_features", "out_features"),
    "GatedMLP": ("gates", "ups", "downs", "activation_fn"),
    "BlockSparseMLP": ("gates", "ups", "downs", "num_experts", "num_local_experts", "num_experts_per_tok",
                       "hidden_size", "intermediate_size", "intermediate_size_padded", "routing_fn", "routing_cfg",
                       "routing_gate", "routing_device", "router_pre_norm", "routed_pre_norm", "routed_post_norm",
                       "shared_experts", "shared_experts_post_norm", "shared_gate", "activation_fn", "act_limit",
                       "interm_div", "gated", "latent_in", "alt_residual_channel", "tp_reduce", "cpu_split_first",
                       "cpu_offload", "is_quantized", "support_quant_paths", "bc"),
    "SlidingAttention": ("window_right", "sliding_window"),
    "DFlashInputLayer": ("attached_model",),
}
SET_BY_GENERATOR = {"Cache": ("owner_serial",)}     # checked once a Generator owns the cache, not at load
MODULE_KINDS = ("Module", "Linear", "GatedMLP", "BlockSparseMLP", "SlidingAttention", "DFlashInputLayer")
INNER_KINDS = ("LinearEXL3", "LinearFP16")      # what a Linear holds in `inner`
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


def check_instance(kind: str, obj, skip: tuple[str, ...] = ()) -> None:
    """One-line ToolkitError when a live exllamav3 object lacks an attribute the toolkit reads (but `skip`)."""
    lacking = [a for a in INSTANCE_ATTRS[kind] if a not in skip and not hasattr(obj, a)]
    if lacking:
        raise ToolkitError(f"exllamav3 {version()}: a {kind} has no {lacking[0]!r} (tested with exllamav3 {TESTED})")


def check_loaded(model, cache=None) -> None:
    """Check a freshly loaded model, its cache and the first module of each kind it holds (and the first EXL3 and
    16-bit weights inside its Linears) for the attributes the toolkit reads: one-line ToolkitError naming the first
    that is missing, at load rather than deep inside a round."""
    check_instance("Model", model)
    if cache is not None:
        check_instance("Cache", cache, skip=SET_BY_GENERATOR["Cache"])
    pending: dict[str, type] | None = None
    for module in model:
        if pending is None:                          # resolved at the first module: a model may have none
            pending = {k: c for k in MODULE_KINDS + INNER_KINDS if (c := get(k)) is not None}
        for kind, cls in list(pending.items()):
            obj = getattr(module, "inner", None) if kind in INNER_KINDS else module
            if isinstance(obj, cls):
                check_instance(kind, obj)
                del pending[kind]
        if not pending:
            return


@contextmanager
def swapped(name: str, replacement) -> Iterator[None]:
    """Within it, the module-level function of seam `name` is `replacement` where exllamav3 looks it up."""
    module, _, attr = SEAMS[name].path.partition(":")
    owner = importlib.import_module(module)
    original = getattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        yield
    finally:
        setattr(owner, attr, original)
