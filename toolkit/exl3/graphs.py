"""A model's whole decode forward replayed from one CUDA graph per shape: every layer and the LM head in one launch.

exllamav3 walks a model's layers in Python and graphs at most one module at a time, so a verify round of a 40-layer
MoE target issues about a thousand kernel launches from the host, and the GPU waits on them. `ForwardGraphs` stands
in for a model's `forward_ls` (the layer walk) on decode-sized calls:

- the leading modules that work on the host (the embedding table exllamav3 keeps in CPU memory, a DFlash drafter's
  input layer) run eagerly, as before;
- everything after them is captured once per shape and replayed: the call copies its hidden state, block table,
  cache lengths and recurrent-state slots into the graph's static inputs, replays, and hands back copies of the
  logits and the hidden states a drafter taps, with the host-side records a forward leaves (the shape of a
  speculative pass on each recurrent layer, for its rewind) set as the eager forward sets them.

A shape is the jobs, tokens, block-table width, dtypes and every scalar parameter of the call. Its first `WARM` calls
run eagerly (kernels compile and tune, lazy buffers take their size); the next one runs eagerly once more on the
static inputs and is captured. Calls the graphs do not take (prefill chunks, more than `MAX_JOBS` jobs, a parameter
of an unknown kind, a shape the caller refuses) run eagerly, and the first of each kind says why in one log line. A
capture that fails leaves every later call of that model eager (what the failed capture touched is not trusted).

Captured kernels read exactly what the eager forward read, so a replay's output equals the eager forward's on the
same kernels. exllamav3's own per-module graphs cannot be launched inside a capture; run the process with
EXL3_GRAPHS=0 (exllamav3 then issues the same kernels eagerly, and these graphs hold them) or the capture fails and
the shape stays eager.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .host_writes import records, writes

log = logging.getLogger(__name__)

MAX_TOKENS = 16          # tokens per job a graphed call may carry (a verify block of 16; prefill chunks stay eager)
MAX_JOBS = 32            # jobs per graphed call
MAX_GRAPHS = 128         # shapes kept per model; calls of further shapes run eagerly
WARM = 2                 # eager calls of a shape before it is captured
# Tensors of a call's parameters that change from call to call (copied into the static inputs on every replay).
DYNAMIC = ("block_table", "cache_seqlens", "positions", "position_ids", "recurrent_slots", "recurrent_slots_scan",
           "recurrent_slots_scan_in")
# Parameters that never reach a kernel, or reach it only through DYNAMIC's tensors.
IGNORED = ("dev_cache", "layer_instance", "resid_defer", "input_ids", "pinned_staging")
# Recurrent states whose forward reads only tensors (their slots reach the kernels through DYNAMIC); others, such as
# a sliding window's ring position, steer the forward from the host and stay eager.
SAFE_STATES = ("GDNState",)
REFUSED = ("batch_shape", "past_len", "indexed_embeddings", "draft_embedding", "export_draft_conf")


def cuda_capture(graph, fn: Callable, pool):
    """Capture `fn()` into `graph` (its allocations from `pool`) and return what it returned."""
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        return fn()


def describe(name: str, value, safe_states: tuple[str, ...] = SAFE_STATES) -> tuple | str:
    """What of one parameter a captured forward depends on (part of the shape key), or why it cannot be captured."""
    if name in REFUSED and value is not None and value is not False and not (isinstance(value, list) and not value):
        return f"the call passes {name}"
    if name in IGNORED or value is None:
        return ()
    if name == "recurrent_states":
        kinds = {type(v).__name__ for v in value}
        unsafe = sorted(kinds - set(safe_states))
        return f"recurrent states of kind {unsafe[0]} steer the forward from the host" if unsafe else ()
    if isinstance(value, torch.Tensor):
        return (name, tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (bool, int, float, str)):
        return (name, value)
    if isinstance(value, (set, frozenset)) and all(isinstance(v, int) for v in value):
        return (name, tuple(sorted(value)))
    if name == "cache":
        return (name, id(value))
    if isinstance(value, (list, tuple)) and not value:
        return (name, ())
    return f"parameter {name} holds a {type(value).__name__}"


def shape_key(x: torch.Tensor, params: dict, safe_states: tuple[str, ...] = SAFE_STATES) -> tuple | str:
    """The key of a call's graph, or why the call runs eagerly."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return "the input is not a batch of rows"
    jobs, tokens = int(x.shape[0]), int(x.shape[1])
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens per job (prefill; graphs take up to {MAX_TOKENS})"
    if jobs > MAX_JOBS:
        return f"{jobs} jobs (graphs take up to {MAX_JOBS})"
    parts: list = [("x", tuple(x.shape), x.dtype, x.device.type)]
    for name in sorted(params):
        d = describe(name, params[name], safe_states)
        if isinstance(d, str):
            return d
        if d:
            parts.append(d)
    return tuple(parts)


def copy_out(value):
    """A copy of a graph's output (tensors, or lists of them) that the next replay cannot overwrite."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [copy_out(v) for v in value]
    return value


@dataclass
class Entry:
    """One captured shape: the graph, its static inputs and outputs, and what the forward leaves on the host."""

    graph: object
    hidden: torch.Tensor
    statics: dict[str, torch.Tensor]                    # every changing parameter, aliases under each name
    out: object
    added: dict = field(default_factory=dict)           # parameters the forward adds (the tapped hidden states)
    effects: list = field(default_factory=list)         # (object, attribute, value) the forward sets
    windows: list = field(default_factory=list)         # window-layer preparations a replay refills (window_graphs.py)
    inputs: list = field(init=False)                     # (name, tensor) once per static tensor: what a replay copies

    def __post_init__(self):
        self.inputs = list({id(t): (name, t) for name, t in self.statics.items()}.values())


class ForwardGraphs:
    """Stands in for `model.forward_ls(x, params)`; `install()` puts it on the model, `uninstall()` takes it off.

    `head`: how many leading modules run eagerly (None: those exllamav3 keeps on the CPU or feeds from it).
    `states(params)`: the host objects whose records a forward writes. `to_device(params, key, device)`: a
    parameter's tensor on the device (exllamav3's get_for_device). `windows(modules)`: a drafter's window-layer
    preparations (window_graphs.WindowPreps) over the captured modules, which lets its window states in. `blocker()`:
    why nothing may be captured in this process, or None. `refuse(x, params)`: why a call's shape must stay eager
    (a layer that would sync with the host at its rows), asked once per shape. Tests pass `capture` and `new_graph`.
    """

    def __init__(self, model, to_device: Callable, states: Callable | None = None, head: int | None = None,
                 capture: Callable = cuda_capture, new_graph: Callable | None = None, pool=None,
                 windows: Callable | None = None, blocker: Callable[[], str | None] | None = None,
                 refuse: Callable[..., str | None] | None = None):
        self.model, self.to_device, self.states = model, to_device, states or (lambda params: ())
        self.capture, self.new_graph, self.pool = capture, new_graph or torch.cuda.CUDAGraph, pool
        self.original = type(model).forward_ls.__get__(model)
        modules = list(model.fwd_modules)
        self.head = eager_head(modules) if head is None else head
        self.head_modules, self.tail_modules = modules[:self.head], modules[self.head:]
        self.device = one_device(self.tail_modules)
        self.windows = windows([s for m, _, _ in self.tail_modules for s in submodules(m)]) if windows else None
        self.safe_states = SAFE_STATES + (("SWAState",) if self.windows else ())
        self.blocker = blocker or (lambda: None)
        self.refuse = refuse or (lambda x, params: None)
        self.broken: str | None = None     # why nothing more is captured (a capture failed)
        self.seen: dict[tuple, int] = {}
        self.graphs: dict[tuple, Entry] = {}
        self.failed: dict[tuple, str] = {}
        self.said: set[str] = set()
        self.calls = {"replayed": 0, "captured": 0, "eager": 0}
        self.capture_s = 0.0
        self.memory = 0                    # bytes the allocator reserved more across the captures (the graphs' pool)

    # -- installing -------------------------------------------------------------------------------------------

    def install(self) -> ForwardGraphs:
        self.model.forward_ls = self
        return self

    def uninstall(self) -> None:
        if vars(self.model).get("forward_ls") is self:
            del self.model.forward_ls

    # -- the call ---------------------------------------------------------------------------------------------

    def __call__(self, x, params: dict):
        key = self.why_eager() or shape_key(x, params, self.safe_states)
        if isinstance(key, str):
            return self.eager(key, x, params)
        entry = self.graphs.get(key)
        if entry is not None:
            return self.replay(entry, self.run_head(x, params), params)
        if key in self.failed:
            return self.eager(self.failed[key], x, params)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= WARM:
            self.calls["eager"] += 1
            return self.original(x, params)
        if len(self.graphs) >= MAX_GRAPHS:
            return self.eager(f"{MAX_GRAPHS} shapes captured already", x, params)
        if why := self.refuse(x, params):
            self.failed[key] = why
            return self.eager(why, x, params)
        return self.record(key, self.run_head(x, params), params)

    def why_eager(self) -> str | None:
        if self.broken:
            return self.broken
        if why := self.blocker():
            return why
        if self.device is None:
            return "the layers after the embedding are not all on one CUDA device"
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "a capture is in progress"
        return None

    def eager(self, why: str, x, params: dict):
        self.calls["eager"] += 1
        self.note(why)
        return self.original(x, params)

    def note(self, why: str) -> None:
        """One log line per reason calls run eagerly."""
        if why not in self.said:
            self.said.add(why)
            log.warning("forward graphs: %s; those calls run eagerly", why)

    def run_head(self, x, params: dict):
        """The leading modules, eagerly, as exllamav3's layer walk runs them: their output enters the graph."""
        for module, instance, _ in self.head_modules:
            params["layer_instance"] = instance
            params["resid_defer"] = False
            x = module.forward(module.prepare_for_device(x, params), params)
        params.pop("resid_defer", None)
        return x.to(self.device)

    def run_tail(self, x, params: dict):
        saved = self.model.fwd_modules
        self.model.fwd_modules = self.tail_modules
        try:
            return self.original(x, params)
        finally:
            self.model.fwd_modules = saved

    # -- capture and replay -----------------------------------------------------------------------------------

    def static_params(self, params: dict, statics: dict[str, torch.Tensor]) -> dict:
        out = {k: v for k, v in params.items() if k not in ("dev_cache", "export_states")}
        out.update(statics)
        return out

    def run_static(self, hidden, params: dict, statics: dict) -> tuple:
        """(output, the parameters after the forward) of the tail over the static inputs."""
        run = self.static_params(params, statics)
        return self.run_tail(hidden, run), run

    def live_inputs(self, params: dict) -> dict[str, torch.Tensor]:
        """The call's changing tensors on the graph's device; one tensor under two names stays one."""
        got: dict[str, torch.Tensor] = {}
        for name in DYNAMIC:
            if isinstance(params.get(name), torch.Tensor):
                got[name] = self.to_device(params, name, self.device)
        return got

    def record(self, key: tuple, hidden, params: dict):
        """Run this call eagerly on fresh static inputs (its result is the call's), then capture the same."""
        t0 = time.perf_counter()
        live = self.live_inputs(params)
        statics, by_ptr = {}, {}
        for name, t in live.items():
            ptr = (t.data_ptr(), tuple(t.shape), t.dtype)
            statics[name] = by_ptr.setdefault(ptr, t.clone())
        hidden_s, base = hidden.clone(), dict(params)
        watched = list(self.states(params))
        before = records(watched)
        with writes(watched) as written:
            out, run = self.run_static(hidden_s, base, statics)
        after = records(watched)
        effects = [(o, k, v) for (i, k), (o, v) in after.items()
                   if (i, k) in written or before.get((i, k), (None, object()))[1] != v]
        added = {k: v for k, v in run.items() if k not in base and k not in IGNORED}   # the tapped states
        params.update(added)
        reserved = reserved_bytes(self.device)
        try:
            if self.pool is None and self.device.type == "cuda":
                self.pool = torch.cuda.graph_pool_handle()   # one pool for every shape: a forward's scratch is shared
            graph = self.new_graph()
            if self.windows:
                self.windows.start()
            try:
                gout, cap = self.capture(graph, lambda: self.run_static(hidden_s, base, statics), self.pool)
            finally:
                windows = self.windows.stop() if self.windows else []
        except Exception as e:       # a sync or a copy the capture cannot hold: this model's forwards stay eager
            first = str(e).splitlines()[0][:200] if str(e) else ""
            self.broken = f"a capture failed ({type(e).__name__}: {first}, at {where(e)})"
            self.note(self.broken)
            return out
        gadded = {k: cap[k] for k in added if k in cap}
        self.graphs[key] = Entry(graph, hidden_s, statics, gout, gadded, effects, windows)
        self.calls["captured"] += 1
        self.capture_s += time.perf_counter() - t0
        self.memory += max(0, reserved_bytes(self.device) - reserved)   # a forward may hand cached blocks back
        return out

    def replay(self, entry: Entry, hidden, params: dict):
        entry.hidden.copy_(hidden)
        live = self.live_inputs(params)
        for name, static in entry.inputs:
            static.copy_(live[name])
        if entry.windows:
            self.windows.refill(entry.windows, params)
            self.windows.start()                       # a real graph runs no Python; a stand-in reads the statics
            try:
                entry.graph.replay()
            finally:
                self.windows.stop()
        else:
            entry.graph.replay()
        for name, value in entry.added.items():
            params[name] = copy_out(value)
        for obj, attr, value in entry.effects:
            setattr(obj, attr, value)
        self.calls["replayed"] += 1
        return copy_out(entry.out)

    def report(self) -> dict:
        """Calls by how they ran, shapes captured, seconds spent capturing, the memory the captures took (MiB the
        allocator reserved more across them: a lower bound), and why calls ran eagerly."""
        return {**self.calls, "shapes": len(self.graphs), "capture_s": round(self.capture_s, 3),
                "memory_mib": round(self.memory / 2**20, 1), "eager_because": sorted(self.said)}


def where(e: Exception) -> str:
    """The innermost file:line of an exception's traceback, for the one log line."""
    tb = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename] or \
        traceback.extract_tb(e.__traceback__)
    return f"{'/'.join(tb[-1].filename.split('/')[-2:])}:{tb[-1].lineno}" if tb else "?"


def reserved_bytes(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def eager_head(modules: list) -> int:
    """How many leading modules touch the host: those exllamav3 keeps in CPU memory or feeds with CPU ids, and a
    drafter's input layer (it reads the target's embedding table)."""
    n = 0
    for module, _, _ in modules:
        caps = getattr(module, "caps", {}) or {}
        if not (caps.get("prefer_cpu") or caps.get("x_cpu") or hasattr(module, "attached_model")):
            break
        n += 1
    return n


def submodules(module) -> list:
    """A module and everything inside it (exllamav3's modules iterate over themselves and their children)."""
    try:
        return list(iter(module))
    except TypeError:
        return [module]


def one_device(modules: list) -> torch.device | None:
    """The one CUDA device every module lives on (None when they do not share one)."""
    devices = {torch.device(getattr(m, "device", None) or "cpu") for m, _, _ in modules}
    if len(devices) != 1:
        return None
    return next(iter(devices))


def target_states(params: dict):
    """The recurrent layer states of the call's cache: a speculative pass records its shape on them."""
    cache = params.get("cache")
    layers = getattr(cache, "get_all_recurrent_layers", None)
    return list(layers().values()) if layers else []


def set_forward_graphs(model, on: bool, kept: ForwardGraphs | None = None,
                       refuse: Callable[..., str | None] | None = None) -> ForwardGraphs | None:
    """Put the whole-forward graphs on `model` (on) or take them off; `kept`, the graphs an earlier install built,
    comes back with what it captured; `refuse(x, params)` says why a shape must stay eager. Returns the graphs
    object to keep."""
    if not on:
        if kept is not None:
            kept.uninstall()
        return kept
    if kept is None:
        from . import seams
        from .loading import exl3_graphs_blocker
        from .window_graphs import WindowPreps

        window = seams.get("SlidingAttention")
        kept = ForwardGraphs(model, seams.get("get_for_device"), states=target_states, blocker=exl3_graphs_blocker,
                             windows=lambda modules: WindowPreps(modules, lambda m: isinstance(m, window)) or None,
                             refuse=refuse)
    return kept.install()
