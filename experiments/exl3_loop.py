"""exllamav3's Generator loop for the device scripts: timed, checked for losslessness, and its hook's overhead.

- `run_jobs` drives the bare `Generator.iterate()` loop the way `Exl3Backend.generate_many` does, with the
  toolkit's capture hook on or off and the Round assembly on or off, and times each part: the unhooked library loop
  is the baseline that the hook's and the Round assembly's overhead is measured against. Measurement only, so it
  lives here and the backend stays free of counters.
- `lossless` (device_check): greedy speculative output against the backend's own AR baseline per prompt, one job
  and batched, and `reference_agreement` against a torch reference at the first divergence (near-tie or bug);
  `graphs_identical` (speed shape --identical): forward_graphs off and on, token for token.
- `check_overhead` (device_check's `overhead` check): exllamav3's own loop against the loop with the capture hook,
  and with the hook plus the Round assembly, on one and on 24 jobs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from experiments.harness import free_cuda
from tests.stream_shape import assert_stream_shape
from toolkit.exl3.hook import JobTrack, build_round
from toolkit.quant.speed import first_difference
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round, summarize, tokens_of


@dataclass
class Loop:
    """What one run of the loop emitted and how long its parts took."""

    tokens: list[list[int]] = field(default_factory=list)          # emitted ids per job
    rounds: list[tuple[int, Round]] = field(default_factory=list)  # (job index, Round) when rounds were assembled
    iterations: int = 0                                            # iterate() calls
    seconds: float = 0.0                                           # wall time of the loop, after enqueue
    overhead_s: float = 0.0                                        # of which the capture and the Round assembly
    iterate_s: list[float] = field(default_factory=list)           # per iterate() call
    post_s: list[float] = field(default_factory=list)              # per iterate(): the Round assembly after it
    capture_error: str | None = None                               # first capture problem, with keep_going


def assemble(gen, jobs: list, tracks: list[JobTrack], t_round_ms: float, loop: Loop, keep_going: bool) -> None:
    """generate_many's per-round work: each job's new ids and the drafted block become a Round."""
    for job, tr in zip(jobs, tracks):
        ids = job.sequences[0].sequence_ids
        n = len(ids)
        if n == tr.seen:
            continue
        new = ids.torch_slice(tr.seen, n).reshape(-1).tolist()
        try:
            rnd = build_round(tr, new, job.draft_stats, gen.drafted.get(id(job)), gen.t_draft_ms, t_round_ms)
        except RuntimeError as e:
            if not keep_going:
                raise
            loop.capture_error = loop.capture_error or str(e)[:300]   # a finding, not a reason to stop
            tr.seen, tr.stats_seen = n, len(job.draft_stats)
            continue
        if rnd is not None:
            loop.rounds.append((tr.index, rnd))


def run_jobs(be, prompts: list[list[int]], settings: GenSettings, speculative: bool = True, hooked: bool = True,
             rounds: bool = True, max_steps: int | None = None, keep_going: bool = False) -> Loop:
    """Run prompts as concurrent jobs of the backend's generator until they finish (or for max_steps iterate()
    calls). hooked=False runs exllamav3's own Generator (no capture, so no Rounds); rounds=False skips the
    Round assembly. keep_going records a capture error instead of raising it."""
    gen = be.generator(be.draft_width(settings, speculative), hooked=hooked)
    jobs = be._jobs(prompts, settings)
    tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
    rounds = rounds and hooked
    loop = Loop()
    gen.enqueue(jobs)
    start = time.perf_counter()
    try:
        while gen.num_remaining_jobs() and (max_steps is None or loop.iterations < max_steps):
            t0 = time.perf_counter()
            results = gen.iterate()
            t1 = time.perf_counter()
            for r in results:
                if r.get("stage") == "error":
                    raise RuntimeError(f"exllamav3 job failed: {r.get('error')!r}")
            if rounds:
                assemble(gen, jobs, tracks, (t1 - t0) * 1000.0, loop, keep_going)
            post = time.perf_counter() - t1
            loop.iterations += 1
            loop.iterate_s.append(t1 - t0)
            loop.post_s.append(post)
            loop.overhead_s += post + getattr(gen, "capture_s", 0.0)
    finally:
        loop.seconds = time.perf_counter() - start
        if gen.num_remaining_jobs():          # stopped early: free the jobs' pages
            gen.clear_queue()
    loop.tokens = [j.sequences[0].sequence_ids.torch().reshape(-1).tolist()[len(p):] for j, p in zip(jobs, prompts)]
    return loop


# -- losslessness ----------------------------------------------------------------------------------------

def doc_prompts(tokenizer, n: int = 24, length: int = 32) -> list[list[int]]:
    """32-token windows of stdlib docstrings: the tiny pair's training domain, so rounds accept 0..B-1."""
    from toolkit.train.tiny import corpus

    ids = tokenizer.encode(corpus())
    step = (len(ids) - length) // (n + 1)
    return [ids[(k + 1) * step:(k + 1) * step + length] for k in range(n)]


def reference_agreement(src: Path, prompts: list[list[int]], exl_ar: list[list[int]], max_new: int,
                        exl_spec: list[list[int]] | None = None) -> dict:
    """AR tokens of the torch reference (fp32 on the GPU) vs exllamav3's AR baseline and, when given, exllamav3's
    speculative output vs its AR baseline. At each first divergence: the reference's top-1 margin (logit gap to the
    runner-up) after the common prefix, so a near-tie tells itself apart from a real bug."""
    from toolkit.runtime.torch_backend import TorchBackend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tb = TorchBackend.from_dirs(src, device=dev, dtype=torch.float32)

    @torch.no_grad()
    def margin(prefix: list[int]) -> float:
        top = tb.target(input_ids=torch.tensor([prefix], device=dev)).logits[0, -1].float().topk(2).values
        return round(float(top[0] - top[1]), 4)

    def diverge(p: list[int], x: list[int], y: list[int]) -> dict:
        i = first_difference(x, y)                   # called only where x != y
        return {"at": i, "tokens": [x[i] if i < len(x) else None, y[i] if i < len(y) else None], "ref_margin": margin(p + x[:i])}

    out: dict = {}
    try:
        ref = [tokens_of(tb.generate(p, GenSettings(max_new_tokens=max_new), speculative=False)) for p in prompts]
        parts = [diverge(p, r, e) for p, r, e in zip(prompts, ref, exl_ar) if r != e]
        out["ref_ar_vs_exl3_ar"] = {"same": f"{len(prompts) - len(parts)}/{len(prompts)}", "divergences": parts}
        if exl_spec is not None:
            parts = [diverge(p, a, s) for p, a, s in zip(prompts, exl_ar, exl_spec) if a != s]
            out["exl3_ar_vs_exl3_spec"] = {"same": f"{len(prompts) - len(parts)}/{len(prompts)}", "divergences": parts}
        ms = [m["ref_margin"] for v in out.values() for m in v["divergences"]]
        out["median_ref_margin_all_positions"] = round(statistics.median(
            margin(p + r[:k]) for p, r in zip(prompts[:4], ref[:4]) for k in range(0, len(r), 8)), 4)
        out["max_margin_at_divergence"] = max(ms, default=None)
    finally:
        tb = None                          # frees the reference model before the next check
        free_cuda()
    return out


def lossless(be, prompts: list[list[int]], B: int, label: str, max_new: int) -> dict:
    """Greedy spec vs AR per prompt (1 job), rounds vs final tokens, the batched run, and the unhooked library."""
    st = GenSettings(max_new_tokens=max_new, block_size=B)
    stop = set(be.eos_ids)
    same, rounds_all, kinds = 0, [], {"zero": 0, "partial": 0, "full": 0}
    ar_all, spec_all = [], []
    for p in prompts:
        ar = tokens_of(list(be.generate(p, st, speculative=False)))
        rounds = list(be.generate(p, st))
        spec = tokens_of(rounds)
        assert_stream_shape(rounds, width=B - 1, max_new_tokens=max_new, stop_ids=stop)
        same += spec == ar
        ar_all.append(ar)
        spec_all.append(spec)
        rounds_all += rounds
        for r in rounds[1:-1]:
            kinds["full" if r.full else "zero" if r.accepted == 0 else "partial"] += 1
    batched = {i: [] for i in range(len(prompts))}
    for i, r in be.generate_many(prompts, st):
        batched[i].append(r)
    batch_same = sum(tokens_of(batched[i]) == spec_all[i] for i in batched)
    ar_batch = {i: [] for i in range(len(prompts))}
    for i, r in be.generate_many(prompts, st, speculative=False):
        ar_batch[i].append(r)
    ar_batch_same = sum(tokens_of(ar_batch[i]) == ar_all[i] for i in ar_batch)
    plain = run_jobs(be, prompts[:4], st, hooked=False).tokens
    s = summarize(rounds_all)
    res = {"label": label, "B": B, "prompts": len(prompts), "lossless_1job": f"{same}/{len(prompts)}",
           "batched_spec_equals_1job": f"{batch_same}/{len(prompts)}", "batched_ar_equals_1job": f"{ar_batch_same}/{len(prompts)}",
           "unhooked_equals_hooked": f"{sum(plain[i] == spec_all[i] for i in range(4))}/4",
           "tau": round(s.tau, 3), "rounds": kinds, "accept_per_position": [round(a, 3) for a in s.accept_per_position]}
    res["_ar"], res["_spec"], res["ok"] = ar_all, spec_all, same == len(prompts)
    res["first_diff"] = [first_difference(x, y) for x, y in zip(spec_all, ar_all) if x != y][:10]
    return res


def graphs_identical(be, prompts: list[list[int]], B: int, max_new: int) -> dict:
    """forward_graphs off, on, and on for the target alone, two passes each over the toolkit's defaults: per prompt
    the first token where greedy speculative (block B) and AR output leave the first eager pass's, and the first
    round whose drafted ids do (a replay runs the eager forward's kernels, so every entry should be None)."""
    from dataclasses import replace

    from toolkit.exl3.graphs import set_forward_graphs
    from toolkit.exl3.options import ADOPTED

    st, runs = GenSettings(max_new_tokens=max_new, block_size=B), {}
    for variant in ("eager", "graphs", "target_graphs"):
        be.set_options(replace(ADOPTED, forward_graphs=variant != "eager"))
        if variant == "target_graphs" and be._graphs.get("draft") is not None:
            set_forward_graphs(be.draft, False, be._graphs["draft"])        # the drafter runs eagerly
        for k in range(2):                          # the second pass replays every shape the first met
            got = []
            for p in prompts:
                spec = list(be.generate(p, st))
                got.append((tokens_of(spec), tokens_of(be.generate(p, st, speculative=False)),
                            [r.drafted for r in spec]))
            runs[f"{variant}{k}"] = got

    base = runs["eager0"]
    diffs = {name: [{"spec": first_difference(r[0], b[0]), "ar": first_difference(r[1], b[1]),
                     "drafts": first_difference(r[2], b[2])}
                    for b, r in zip(base, got)] for name, got in runs.items()}
    same = sum(all(v is None for d in diffs[name] for v in d.values()) for name in ("graphs0", "graphs1"))
    return {"identical": f"{same}/2 passes", "first_difference": diffs, "engine": be.engine_report()}


def twin(fg) -> list[dict]:
    """Make every replay of `fg` (a ForwardGraphs) run the same call eagerly first, on the live parameters, put the
    recurrent states back, replay, and record where the two differ: outputs, tapped states, state tensors, host
    records. Returns the list the findings go into (one dict per replay)."""
    from toolkit.exl3.graphs import copy_out
    from toolkit.exl3.host_writes import records

    found: list[dict] = []
    replay = fg.replay

    def tensors(objs):
        return {(id(o), k): (o, k) for o in objs for k, v in vars(o).items()
                if isinstance(v, torch.Tensor) and v.device.type == "cuda" and v.numel()}

    def diff(a, b) -> float | None:
        if isinstance(a, list):
            ds = [diff(x, y) for x, y in zip(a, b)]
            return None if len(a) == len(b) and all(d is None for d in ds) else max([d or 0 for d in ds] + [float("inf") * (len(a) != len(b))])
        if isinstance(a, torch.Tensor):
            return None if torch.equal(a, b) else float((a.float() - b.float()).abs().max())
        return None if a == b else float("nan")

    def checked(entry, hidden, params):
        objs = list(fg.states(params))
        ts = tensors(objs)
        saved = {k: getattr(o, a).clone() for k, (o, a) in ts.items()}
        host = records(objs)
        p = dict(params)
        eager = copy_out(fg.run_tail(hidden.clone(), p))
        e_added = {k: copy_out(v) for k, v in p.items() if k not in params}
        e_states = {k: getattr(o, a).clone() for k, (o, a) in ts.items()}
        e_host = {k: v for k, (o, v) in records(objs).items()}
        for k, (o, a) in ts.items():
            getattr(o, a).copy_(saved[k])
        for (i, k), (o, v) in host.items():
            setattr(o, k, v)
        out = replay(entry, hidden, params)
        rec = {"call": len(found), "rows": list(hidden.shape[:2]), "out": diff(out, eager)}
        rec["added"] = {k: diff(params.get(k), v) for k, v in e_added.items()}
        rec["states"] = {f"{type(ts[k][0]).__name__}.{ts[k][1]}": d for k in ts
                         if (d := diff(getattr(*ts[k]), e_states[k])) is not None}
        rec["host"] = sorted(f"{k}" for (i, k), (o, v) in records(objs).items() if e_host.get((i, k)) != v)
        if isinstance(out, torch.Tensor) and out.dim() == 3:
            rec["argmax_same"] = bool(torch.equal(out.argmax(-1), eager.argmax(-1)))
        found.append(rec)
        return out

    fg.replay = checked
    return found


def graphs_twin(be, prompts: list[list[int]], B: int, max_new: int) -> dict:
    """forward_graphs on, every replay of the target's and the drafter's graphs checked against the same call run
    eagerly (twin); per model the replays that differed, the first few in full."""
    from dataclasses import replace

    from toolkit.exl3.options import ADOPTED

    st = GenSettings(max_new_tokens=max_new, block_size=B)
    be.set_options(replace(ADOPTED, forward_graphs=True))
    for p in prompts[:2]:                               # capture every shape first
        list(be.generate(p, st))
        list(be.generate(p, st, speculative=False))
    found = {name: twin(fg) for name, fg in be._graphs.items() if fg is not None}
    for p in prompts:
        list(be.generate(p, st))
        list(be.generate(p, st, speculative=False))
    out = {}
    for name, recs in found.items():
        bad = [r for r in recs if r["out"] is not None or r["states"] or r["host"]
               or any(v is not None for v in r["added"].values())]
        out[name] = {"replays": len(recs), "differed": len(bad), "first": bad[:4],
                     "shapes": sorted({tuple(r["rows"]) for r in recs})}
    return out


# -- the hook's overhead -------------------------------------------------------------------------------------

def check_overhead(fix: dict, quick: bool) -> dict:
    """Seconds per iterate() of the library's own loop, the loop with our hook, and the hook plus the Round
    assembly generate_many does; interleaved repetitions, medians; plus our own code's share timed directly
    (device_check's `overhead` check, on its fixtures `fix`)."""
    from toolkit.exl3.backend import Exl3Backend

    be = Exl3Backend.from_dirs(fix["target"], fix["draft_bf16"], cache_tokens=32 * 512, max_concurrency=32)
    modes = {"plain": dict(hooked=False), "hook_only": dict(hooked=True, rounds=False), "hook_and_rounds": dict(hooked=True)}
    out = {}
    try:
        prompts = doc_prompts(be.tokenizer, n=24)
        st = GenSettings(max_new_tokens=128, block_size=16)
        for name, batches in (("conc1", [[p] for p in prompts[:4 if quick else 8]]), ("conc24", [prompts])):
            per = {k: [] for k in modes}
            iters, direct = {}, []
            for rep in range(4 if quick else 6):       # interleaved; rep 0 is a warm-up
                tot = {k: [0.0, 0] for k in per}
                ours = 0.0
                for batch in batches:
                    for k in ("hook_and_rounds", "plain", "hook_only"):
                        loop = run_jobs(be, batch, st, **modes[k])
                        tot[k][0] += loop.seconds
                        tot[k][1] += loop.iterations
                        if k == "hook_and_rounds":
                            ours += loop.overhead_s
                for k, (secs, it) in tot.items():
                    per[k].append(secs / it)
                    iters[k] = it
                direct.append(ours / tot["hook_and_rounds"][0] * 100)
            med = {k: statistics.median(v[1:]) for k, v in per.items()}
            out[name] = {f"{k}_ms_per_round": round(v * 1000, 4) for k, v in med.items()}
            out[name].update({f"{k}_overhead_pct": round((med[k] / med["plain"] - 1) * 100, 2) for k in ("hook_only", "hook_and_rounds")})
            out[name]["direct_capture_and_rounds_pct"] = round(statistics.median(direct[1:]), 3)   # timed inside our code
            out[name].update(rounds=iters, all_ms={k: [round(x * 1000, 3) for x in v] for k, v in per.items()})
        return out
    finally:
        free_cuda(be)
