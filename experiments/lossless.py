"""Losslessness on exllamav3 for experiments/device_check.py: greedy speculative output against the backend's own AR
baseline per prompt, one job and batched, and against a torch reference at the first divergence (near-tie or bug)."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from experiments.exl3_timing import run_jobs
from experiments.harness import free_cuda
from tests.stream_shape import assert_stream_shape
from toolkit.quant.speed import first_difference
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import summarize, tokens_of


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
    """forward_graphs off and on over the toolkit's defaults: greedy speculative (block B) and AR tokens per prompt,
    which must be identical token for token (a replay runs the eager forward's kernels), and how the forwards ran."""
    from dataclasses import replace

    from toolkit.exl3.options import ADOPTED

    st, toks = GenSettings(max_new_tokens=max_new, block_size=B), {}
    for on in (False, True):
        be.set_options(replace(ADOPTED, forward_graphs=on))
        for _ in range(2):                              # the second pass replays every shape the first met
            toks[on] = [(tokens_of(list(be.generate(p, st))), tokens_of(list(be.generate(p, st, speculative=False))))
                        for p in prompts]
    same = sum(a == b for a, b in zip(toks[False], toks[True]))
    return {"identical": f"{same}/{len(prompts)}", "tokens": sum(len(s) + len(a) for s, a in toks[True]),
            "engine": be.engine_report()}
