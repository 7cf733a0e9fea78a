"""Where a round's time goes on exllamav3: torch.profiler over timed rounds of one (concurrency, width) shape, the
target's modules and the drafter's step inside labelled ranges, every GPU kernel charged to one part.

Parts: `moe` (a BlockSparseMLP call, everything it launches), `attention` (Attention, SlidingAttention and
GatedDeltaNet calls less the linears inside them), `linears` (the other EXL3 linears: projections and the dense
MLPs), `lm_head`, `drafter` (the DFlash drafter's forward and sampling), `other` (norms, embeddings, sampling,
cache and bookkeeping kernels), and `host_gaps` (wall less GPU busy: the GPU waiting on the host).

`profile_host` (`speed shape`'s `profile` step): the host time our code adds per round, exllamav3's own Generator
against our recording subclass and our whole policy path at c=1, w=7, interleaved windows, GPU busy and idle.
"""

from __future__ import annotations

import contextlib
import statistics
import time

PARTS = ("moe", "attention", "linears", "lm_head", "drafter", "other")
PREFIX = "budget:"


def label_modules(target, draft) -> list:
    """Wrap the target's modules and the drafter's step in record_function ranges; returns the undo list."""
    import torch
    from exllamav3.modules.attn import Attention
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP
    from exllamav3.modules.gated_delta_net import GatedDeltaNet
    from exllamav3.modules.linear import Linear
    from exllamav3.modules.sliding_attn import SlidingAttention

    def labelled(fn, part):
        def call(*a, **k):
            with torch.profiler.record_function(PREFIX + part):
                return fn(*a, **k)
        return call

    undo = []
    for m in target:
        part = "moe" if isinstance(m, BlockSparseMLP) else "attention" if isinstance(
            m, (Attention, SlidingAttention, GatedDeltaNet)) else "lm_head" if getattr(m, "key", "") == "lm_head" \
            else "linears" if isinstance(m, Linear) else None
        if part:
            undo.append((m, "forward", vars(m).get("forward")))
            m.forward = labelled(m.forward, part)
    if draft is not None:
        for name in ("forward", "sample_from_state"):
            if hasattr(draft, name):
                undo.append((draft, name, vars(draft).get(name)))
                setattr(draft, name, labelled(getattr(draft, name), "drafter"))
    return undo


def unlabel(undo: list) -> None:
    for obj, name, old in reversed(undo):
        if old is None:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, old)


def charge(chain: list[str]) -> str:
    """The part a kernel belongs to from the labels around its launch, innermost first: anything inside an MoE call
    or the drafter is theirs, else the innermost label."""
    for part in ("moe", "drafter"):
        if part in chain:
            return part
    return chain[0] if chain else "other"


def merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    """The union of time spans as sorted, disjoint [start, end] runs."""
    runs: list[list[float]] = []
    for s, e in sorted(spans):
        if runs and s <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    return runs


def busy_us(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged(spans))


def split(prof, rounds: int, wall_ms: float) -> dict:
    """ms per round of each part, GPU busy and host gaps, from a finished profiler.

    Each labelled range also shows on the GPU timeline (kineto's GPU user annotations, spanning the kernels
    launched inside it): a kernel goes to the ranges around its start. exllamav3's kernels come from its
    extension, not from torch ops, so the profiler links them to no CPU event; the CPU-side link (each op's
    kernels, charged through its parents) is the fallback where a profiler records no GPU annotations."""
    from torch.autograd import DeviceType

    spans, marks = [], {}
    for ev in prof.events():
        if ev.device_type != DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        if ev.name.startswith(PREFIX):
            marks.setdefault(ev.name[len(PREFIX):], []).append(span)
        elif not getattr(ev, "is_user_annotation", False):
            spans.append(span)
    parts = charge_spans(spans, marks) if marks else charge_ops(prof.events())
    charged = sum(parts.values())
    busy = busy_us(spans) / 1e3 / rounds
    out = {p: round(v / 1e3 / rounds, 3) for p, v in parts.items()}
    out.update(gpu_busy=round(busy, 3), wall=round(wall_ms, 3), host_gaps=round(max(0.0, wall_ms - busy), 3),
               kernels_per_round=round(len(spans) / rounds, 1),
               charged_share=round(charged / 1e3 / rounds / busy, 3) if busy else None,
               charged_by="gpu ranges" if marks else "cpu links")
    return out


NESTING = ("moe", "drafter", "lm_head", "linears", "attention")     # charge() order: owners first, then innermost


def charge_spans(kernels: list[tuple[float, float]], marks: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """us per part of GPU kernels [(start, end)], each charged by the labelled GPU ranges around its start."""
    import bisect

    runs = {part: merged(spans) for part, spans in marks.items()}
    starts = {part: [r[0] for r in rs] for part, rs in runs.items()}

    def inside(part: str, t: float) -> bool:
        i = bisect.bisect_right(starts[part], t) - 1
        return i >= 0 and t < runs[part][i][1]

    parts = {p: 0.0 for p in PARTS}
    for s, e in kernels:
        chain = [p for p in NESTING if p in runs and inside(p, s)]
        parts[charge(chain)] += e - s
    return parts


def charge_ops(events) -> dict[str, float]:
    """us per part of the kernels the profiler links to CPU ops, each charged through the op's labelled parents."""
    parts = {p: 0.0 for p in PARTS}
    for ev in events:
        kernels = getattr(ev, "kernels", None) or []
        if not kernels:
            continue
        chain, p = [], ev
        while p is not None:
            if p.name.startswith(PREFIX):
                chain.append(p.name[len(PREFIX):])
            p = p.cpu_parent
        parts[charge(chain)] += sum(k.duration for k in kernels)
    return parts


def round_budget(be, concurrency: int, width: int | None, rounds: int = 16, context: int = 1024) -> dict:
    """The budget of `rounds` timed rounds of `concurrency` jobs at verify width `width` (None: the plain AR
    generator, no drafter): wall from the same rounds unprofiled first, then the profiled split."""
    from torch.profiler import ProfilerActivity, profile

    from toolkit.exl3.calibrate import time_rounds
    from toolkit.runtime import trace

    spec = width is not None
    plain = time_rounds(be, concurrency, [width or 0], reps=rounds, warm=2, context=context, speculative=spec)
    wall = statistics.median(plain[width or 0])
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    stack = contextlib.ExitStack()

    def listen(kind: str, fields: dict) -> None:
        if kind == "timed" and fields.get("on"):
            stack.enter_context(prof)
        elif kind == "timed":
            stack.close()

    undo = label_modules(be.model, be.draft if spec else None)
    stop = trace.subscribe(listen)
    t0 = time.perf_counter()
    try:
        time_rounds(be, concurrency, [width or 0], reps=rounds, warm=1, context=context, speculative=spec)
    finally:
        stop()
        stack.close()
        unlabel(undo)
    out = split(prof, rounds, wall)
    out.update(concurrency=concurrency, width="AR" if not spec else width, rounds=rounds,
               profiled_s=round(time.perf_counter() - t0, 1))
    return out


def budgets(be, a) -> dict:
    """The round budget (experiments/budget.py) of every `--budget` shape C:W (W a width or AR), stock and with
    the last `--levers` setting."""
    from toolkit.exl3.options import Exl3Options, parse_lever

    out = {}
    for tag, opts in [("stock", Exl3Options())] + [parse_lever(x) for x in a.levers[-1:]]:
        be.set_options(opts)
        for shape in a.budget:
            c, _, w = shape.partition(":")
            out[f"{tag}|{shape}"] = round_budget(be, int(c), None if w.upper() == "AR" else int(w), context=a.context)
    be.set_options(Exl3Options())
    return out


def distinct_experts(be, rows: tuple[int, ...] = (8, 16), calls: int = 8) -> dict:
    """Mean distinct experts one MoE layer's router picks for `rows` random hidden rows (the routing's locality as
    the synthetic weights give it)."""
    import torch
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    moe = next(m for m in be.model if isinstance(m, BlockSparseMLP))
    out = {}
    for r in rows:
        counts = []
        for i in range(calls):
            x = torch.randn((r, moe.hidden_size), device="cuda", generator=torch.Generator(device="cuda").manual_seed(i)).half()
            sel, _ = moe.routing_fn(r, moe.routing_cfg, x, {})
            counts.append(int(sel.unique().numel()))
        out[str(r)] = sum(counts) / len(counts)
    return out


# -- the host time our code adds ---------------------------------------------------------------------------

def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_window(step, rounds: int) -> float:
    """ms per call of step() over `rounds` calls, the device drained before and after."""
    sync()
    t0 = time.perf_counter()
    for _ in range(rounds):
        step()
    sync()
    return (time.perf_counter() - t0) / rounds * 1000.0


def profile_rounds(step, rounds: int) -> dict:
    """Wall, GPU-busy and GPU-idle ms per round over `rounds` calls of step(), under torch.profiler (CUDA)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    plain = timed_window(step, rounds)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed_window(step, rounds)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    gpu = busy_us(spans) / 1e3 / rounds
    return {"rounds": rounds, "wall_ms": round(plain, 3), "profiled_wall_ms": round(wall, 3), "gpu_busy_ms": round(gpu, 3),
            "gpu_idle_ms": round(wall - gpu, 3), "gpu_events": len(spans)}


VARIANTS = ("exllamav3", "recording", "policy")


def start_variant(be, name: str, prompts, st, w: int):
    """(step, close) of one variant at width w, past 4 warm rounds: exllamav3's own Generator, our recording
    subclass, or our whole policy path (decode_many with a policy forced to w)."""
    from toolkit.policy.chooser import Policy
    from toolkit.costs.table import CostTable

    if name == "policy":
        class Forced(Policy):
            def width(self, jobs: int = 1) -> int:
                return w

        it = be.decode_many(prompts, be._jobs(prompts, st), 0, Forced(be.block_size, CostTable({1: {0: 1.0, 1: 1.0}})))
        step, close = (lambda: next(it)), it.close
    else:
        gen = be.generator(w, hooked=name == "recording")
        gen.enqueue(be._jobs(prompts, st))
        step, close = gen.iterate, gen.clear_queue
    for _ in range(4):
        step()
    return step, close


def profile_host(be, a) -> dict:
    """Wall ms per round at c=1, w=7 of the three variants, `a.profile_reps` interleaved windows each (the order
    rotating), their medians and what our code adds to them; the last window of each also under torch.profiler
    (GPU busy and idle). GPU busy is the same kernels in every variant, so wall differences are host time."""
    import statistics

    from toolkit.runtime.backend import GenSettings
    from toolkit.exl3.calibrate import dummy_prompts

    n, w, reps = a.profile_rounds, 7, max(1, a.profile_reps)
    prompts = dummy_prompts(1, a.context, be.vocab_size)
    st = GenSettings(max_new_tokens=(n * 2 + 8) * (w + 1), block_size=None, stop_ids=())
    walls, out = {v: [] for v in VARIANTS}, {}
    for rep in range(reps):
        for name in VARIANTS[rep % 3:] + VARIANTS[:rep % 3]:
            step, close = start_variant(be, name, prompts, st, w)
            try:
                if rep == reps - 1:
                    out[name] = profile_rounds(step, n)
                    walls[name].append(out[name]["wall_ms"])
                else:
                    walls[name].append(round(timed_window(step, n), 3))
            finally:
                close()
    for name in VARIANTS:
        out[name].update(wall_ms=round(statistics.median(walls[name]), 3), wall_ms_reps=walls[name])
    for key, name in (("capture", "recording"), ("policy_path", "policy")):
        out[f"added_by_{key}_ms"] = round(out[name]["gpu_idle_ms"] - out["exllamav3"]["gpu_idle_ms"], 3)
        out[f"added_wall_by_{key}_ms"] = round(out[name]["wall_ms"] - out["exllamav3"]["wall_ms"], 3)
    return out
