"""The adopted lever on the DFlash drafter's step on exllamav3 (at c=1 the step is host-bound).

`graph_draft_swa`: exllamav3 sends a sliding-window layer through its graph-captured decode attention (BC:
projections through o_proj replayed as one CUDA graph) only when params["causal"] is True or the layer's right
window spans the block. A DFlash checkpoint that leaves `is_causal` unset has causal sliding layers (right window
0) next to a bidirectional full layer, so params["causal"] is False and every sliding layer takes the eager path.
The wrap sets causal=True around those layers: the same mask (a right window of 0 is causal), taken through the
graph. It changes only how the drafter computes its block, never what the target verifies.
"""

from __future__ import annotations



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


def set_draft_levers(draft, options, before, classes: tuple[type, ...] | None = None) -> None:
    """Install or remove the wrap on the drafter as `options` (an Exl3Options) asks; `before`: the options in force
    until now. `classes`: (sliding attention,), exllamav3's own unless given (tests); nothing is imported when the
    lever neither is nor was on."""
    if not (options.graph_draft_swa or before.graph_draft_swa):
        return
    if next(iter(draft), None) is None:           # no modules (a stand-in drafter): nothing to wrap
        return
    swa_class = (classes or exllamav3_classes())[0]
    set_forward_wrap(draft, swa_class, CausalWindowForward, options.graph_draft_swa)


def set_forward_wrap(model, module_class: type, wrap: type, on: bool) -> int:
    """Install (on) or remove `wrap(module)` as the instance forward of every `module_class` module of `model`
    (removing restores the class's own); returns how many such modules there are. A removed wrap stays on the
    module and comes back when turned on again, with what it built (the MoE paths' tables and CUDA graphs)."""
    n, kept = 0, f"_kept_{wrap.__name__}"
    for m in model:
        if not isinstance(m, module_class):
            continue
        has = isinstance(vars(m).get("forward"), wrap)
        if on and not has:
            if not isinstance(vars(m).get(kept), wrap):
                setattr(m, kept, wrap(m))
            m.forward = getattr(m, kept)
        elif not on and has:
            del m.forward
        n += 1
    return n


def exllamav3_classes() -> tuple[type, ...]:
    from . import seams

    return (seams.get("SlidingAttention"),)
