"""The timing rig of experiments/perf_synth.py: exllamav3 forwards called directly, the way its Generator calls
them, on the caches of an Exl3Backend, with the context filled without computing it.

Context: the target's K/V pages are zeroed and each job gets an exllamav3 test state at position ctx
(`Cache.get_test_state`), so attention runs over ctx keys; the drafter's sliding-window rings are placed so
that a full window sits behind the position. Values are zeros / garbage; costs depend on lengths only.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

PAGE = 256
VOCAB_IDS = 248000           # random input ids are drawn below the specials


def pages(n: int) -> int:
    return -(-n // PAGE)


def seq_cap(ctx: int, block: int = 16) -> int:
    """Tokens of cache one job needs at this context: the context, a block and the bonus, in whole pages."""
    return pages(ctx + block + 1) * PAGE


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 4)


class Terms:
    """Per-term wall times; in sync mode each term is bracketed by cuda synchronisations."""

    def __init__(self, sync: bool):
        self.sync, self.t = sync, {}

    @contextmanager
    def __call__(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0


class Rig:
    """Direct forwards over an Exl3Backend's target, drafter and caches."""

    def __init__(self, be):
        self.be, self.t, self.tc = be, be.model, be.cache
        self.set_draft(be.draft, be.draft_cache)
        for layer in self.tc.layers.values():              # zeroed pages: no NaN from stale memory in attention
            for x in layer.get_tensors():
                x.zero_()

    def set_draft(self, draft, draft_cache) -> None:
        self.d, self.dc = draft, draft_cache
        self.d.attach_to(self.t)                             # what the Generator does for a DFlash drafter
        self.swa = [m for m in self.d.attn_modules if hasattr(m, "kv_state_size")]

    def states(self, c: int, ctx: int):
        ts = [self.tc.get_test_state(ctx) for _ in range(c)]
        ds = None
        if self.d.recurrent_state_cls is not None:
            ds = [self.dc.get_test_state(ctx) for _ in range(c)]
            if self.swa:                                     # a full window behind the position, as after a prefill
                hot = min(ctx, self.swa[0].kv_state_size - PAGE)
                for s in ds:
                    s.window_beg = pages(ctx - hot) * PAGE
        return ts, ds

    @staticmethod
    def free(*groups) -> None:
        for g in groups:
            for s in g or []:
                s.free()

    @staticmethod
    def reset(ctx: int, *groups) -> None:
        for g in groups:
            for s in g or []:
                s.position, s.last_history = ctx, 0

    def tparams(self, c: int, ctx: int, ts, history: bool) -> dict:
        p = {"attn_mode": "flash_attn", "cache": self.tc, "batch_shape": (c, seq_cap(ctx)), "past_len": ctx,
             "recurrent_states": ts, "pinned_staging": True}            # as the Generator's target forwards
        if history:
            p["recurrent_history"] = True
            p.update(self.d.draft_verifier_params)           # the taps the drafter reads (export_state_layers)
        return p

    def ids(self, c: int) -> torch.Tensor:
        return torch.randint(0, VOCAB_IDS, (c, 1), dtype=torch.long)

    def ar(self, c: int, ctx: int, ts) -> None:
        """One plain decode step: the target over 1 token per job, argmax, ids to the host."""
        logits = self.t.forward(self.ids(c), self.tparams(c, ctx, ts, False))
        torch.argmax(logits, dim=-1).cpu()
        self.reset(ctx, ts)

    def round(self, c: int, ctx: int, B: int, accepted: int, ts, ds, terms: Terms) -> None:
        """One speculative round as Generator.iterate() runs it for DFlash, minus its per-job Python."""
        ids = self.ids(c)
        with terms("draft"):                                 # drafter block (native size) + target lm_head argmax
            p = {"attn_mode": "flash_attn", "cache": self.dc, "batch_shape": (c, seq_cap(ctx)), "past_len": ctx}
            if ds is not None:
                p["recurrent_states"] = ds
            out = self.d.forward(ids, p)
            drafted = self.d.sample_from_state(out, p)[:, 1:B].cpu()
        with terms("verify"):
            pv = self.tparams(c, ctx, ts, True)
            logits = self.t.forward(torch.cat([ids, drafted], dim=1), pv)
        with terms("sample"):
            torch.argmax(logits, dim=-1).cpu()
        with terms("rewind"):                                # keep `accepted` drafts + the bonus
            for s in ts:
                s.rewind(B - 1 - accepted)
            for s in ds or []:
                s.rewind(max(0, s.last_history - accepted))
        with terms("draft_update"):                          # drafter K/V of the accepted rows from the taps
            up = {"block_table": pv["block_table"], "cache_seqlens": pv["cache_seqlens"]}
            if ds is not None:
                up["recurrent_states"] = ds
            self.d.update_kv_from_target(target_hidden=pv["export_states"], cache=self.dc, params=up,
                                         lengths=[accepted + 1] * c)
        self.reset(ctx, ts, ds)


def timed(fn, reps: int, warm: int) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


@torch.inference_mode()
def group(rig: Rig, c: int, ctx: int, blocks, accepted: dict, reps: int, warm: int, with_ar: bool) -> dict:
    """AR and rounds for one (concurrency, context): medians in ms, the breakdown per term, the peak transient."""
    ts, ds = rig.states(c, ctx)
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        res: dict = {"c": c, "ctx": ctx}
        if with_ar:
            s = timed(lambda: rig.ar(c, ctx, ts), reps, warm)
            res["ar_ms"], res["ar_all_ms"] = median_ms(s), [round(x * 1000, 3) for x in s]
        for B in blocks:
            a = accepted[B]
            for _ in range(warm):
                rig.round(c, ctx, B, a, ts, ds, Terms(True))
            per = [Terms(True) for _ in range(reps)]
            for tm in per:
                rig.round(c, ctx, B, a, ts, ds, tm)
            e2e = timed(lambda: rig.round(c, ctx, B, a, ts, ds, Terms(False)), reps, 0)
            res[f"B{B}"] = {"round_ms": median_ms(e2e), "round_all_ms": [round(x * 1000, 3) for x in e2e], "accepted": a,
                            "terms_ms": {k: median_ms([tm.t[k] for tm in per]) for k in per[0].t}}
        torch.cuda.synchronize()
        res["transient_bytes"] = torch.cuda.max_memory_allocated() - base
        return res
    finally:
        rig.free(ts, ds)


def toolkit_cost(c: int, B: int, accepted: int, rounds: int = 200) -> dict:
    """Host time of the toolkit's per-round bookkeeping for c jobs: the hook's capture of the drafted block
    (exl3_hook.RecordingGenerator) and the Round assembly of Exl3Backend.generate_many (exl3_hook.build_round)."""
    from toolkit.exl3.hook import JobTrack, build_round

    class Job:                                               # what the hook reads from an exllamav3 job
        def is_prefill_done(self) -> bool:
            return True

    jobs = [Job() for _ in range(c)]
    pinned = torch.randint(0, VOCAB_IDS, (32, 15), dtype=torch.long)
    pinned = pinned.pin_memory() if torch.cuda.is_available() else pinned
    tracks = [JobTrack(i, 1024) for i in range(c)]
    seqs = [torch.zeros(1024 + rounds * B, dtype=torch.long) for _ in range(c)]
    stats: list[list] = [[] for _ in range(c)]
    hook, post = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        t_a = time.perf_counter()
        block = pinned[:c, :B - 1].tolist()
        drafted = {id(j): tuple(x) for j, x in zip([j for j in jobs if j.is_prefill_done()], block)}
        _ = (time.perf_counter() - t_a) * 1000.0
        t1 = time.perf_counter()
        for j, (job, tr) in enumerate(zip(jobs, tracks)):
            row = drafted[id(job)]
            seqs[j][tr.seen:tr.seen + accepted].copy_(torch.tensor(row[:accepted]))
            n = tr.seen + accepted + 1
            stats[j].append((r, B - 1, accepted))
            t_s = time.perf_counter()
            new = seqs[j][tr.seen:n].reshape(-1).tolist()
            build_round(tr, new, stats[j], row, 1.0, 2.0)
            post.append(time.perf_counter() - t_s)
        hook.append(t1 - t0)
    per_round_post = [sum(post[i * c:(i + 1) * c]) for i in range(rounds)]
    return {"c": c, "B": B, "hook_ms": median_ms(hook), "rounds_ms": median_ms(per_round_post),
            "total_ms": round(median_ms(hook) + median_ms(per_round_post), 4)}
