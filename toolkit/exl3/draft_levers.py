"""Two levers of ours on the DFlash drafter's step on exllamav3 1.6.5 (issue 16: at c=1 the step is host-bound,
about 1 ms of kernels in 3 ms on an H100).

- `graph_draft_swa`: exllamav3 sends a sliding-window layer through its graph-captured decode attention (BC:
  projections through o_proj replayed as one CUDA graph) only when params["causal"] is True or the layer's right
  window spans the block. A DFlash checkpoint that leaves `is_causal` unset has causal sliding layers (right
  window 0) next to a bidirectional full layer, so params["causal"] is False and every sliding layer takes the
  eager path. The wrap sets causal=True around those layers: the same mask (a right window of 0 is causal), taken
  through the graph.
- `chunked_draft_mlp`: exllamav3's fused GatedMLP call (BC_GatedMLP) takes at most 8 rows; the drafter's 16-row
  block at c=1 falls to the eager gate/up/down path. As chunked_verify does for the target's MoE, 9..16 rows go
  through the fused call in chunks of <= 8 rows.

Both change only how the drafter computes its block, never what the target verifies, so output stays the
target's (greedy output identical to AR); the drafted ids can differ only by kernel rounding.
"""

from __future__ import annotations

from .options import set_chunked_verify, set_forward_wrap


class CausalWindowForward:
    """A SlidingAttention's forward that runs with params["causal"] True when its right window is 0."""

    def __init__(self, module):
        self.module = module
        self.inner = type(module).forward.__get__(module)      # the class's own forward, bound

    def __call__(self, x, params: dict, out_dtype=None):
        if not applies(self.module, params):
            return self.inner(x, params, out_dtype)
        params["causal"] = True
        try:
            return self.inner(x, params, out_dtype)
        finally:
            params["causal"] = False              # the full layer after it reads the block's own flag


def applies(module, params: dict) -> bool:
    """A decode step of a causal window layer (right window 0, finite left window) under a non-causal flag."""
    return (params.get("causal") is False and getattr(module, "window_right", None) == 0
            and (getattr(module, "sliding_window", -1) or -1) > 0 and params.get("attn_mode") == "flash_attn"
            and not params.get("non_causal_spans"))


def set_graph_draft_swa(model, swa_class: type, on: bool) -> int:
    """Install (on) or remove the causal-flag wrap on every `swa_class` module of the drafter; returns how many."""
    return set_forward_wrap(model, swa_class, CausalWindowForward, on)


def set_draft_levers(draft, options, before, classes: tuple[type, type] | None = None) -> None:
    """Install or remove the two wraps on the drafter as `options` (an Exl3Options) asks; `before`: the options in
    force until now. `classes`: (sliding attention, gated MLP), exllamav3's own unless given (tests); nothing is
    imported when neither lever is or was on."""
    if not (options.graph_draft_swa or before.graph_draft_swa or options.chunked_draft_mlp or before.chunked_draft_mlp):
        return
    if next(iter(draft), None) is None:           # no modules (a stand-in drafter): nothing to wrap
        return
    swa_class, mlp_class = classes or exllamav3_classes()
    if options.graph_draft_swa or before.graph_draft_swa:
        set_graph_draft_swa(draft, swa_class, options.graph_draft_swa)
    if options.chunked_draft_mlp or before.chunked_draft_mlp:
        set_chunked_verify(draft, mlp_class, options.chunked_draft_mlp)   # the same row chunks: rows are independent


def exllamav3_classes() -> tuple[type, type]:
    from exllamav3.modules.mlp import GatedMLP
    from exllamav3.modules.sliding_attn import SlidingAttention

    return SlidingAttention, GatedMLP
