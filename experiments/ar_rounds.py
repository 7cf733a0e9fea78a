"""The AR rounds of the speculative Generator on the H200 (issue 16; experiments/speed.py, mode `ar`).

exllamav3 1.6.5 updates the drafter's K/V from the target's taps for every token even when a round drafts
nothing (w = 0), measured at 1.09-1.34x an AR step (docs/performance.md). The `defer_draft_kv` lever
(toolkit/runtime/exl3_defer.py) keeps those updates during an AR stretch and writes them in one call before
the drafter runs again. One call compares, on the synthetic real shape:

- `ar`: the Generator without drafter (a true AR step);
- `today`: the policy's rounds with exllamav3's per-token update: a stretch of `stretch` AR rounds, then one
  drafted round of width `draft_width`;
- `cut`: the same sequence with defer_draft_kv on (the drafted round carries the catch-up write).

Each repetition times every (c, variant), the order of today and cut alternating, through the backend's own
timer (toolkit.exl3.calibrate.time_rounds: steady-state dummy jobs, one untimed pass first). Per cell and
repetition: the mean and median ms of the w = 0 rounds, the drafted round, and the mean over the whole stretch
(what a token costs there); medians and spread over the repetitions. Then a greedy check on a few dummy prompts
with a forced pattern of widths: tokens of AR, today and cut, and today's Round stream against the cut's.
"""

from __future__ import annotations

import statistics

from experiments.harness import Repetitions, warm_up

STRETCH = 16          # AR rounds per stretch before the drafter runs again
DRAFT_WIDTH = 7       # the drafted round that ends a stretch
CHECK_TOKENS = 96     # new tokens per job in the greedy check


def stretch_widths(stretch: int, draft_width: int) -> list[int]:
    """One pass of the timed sequence: `stretch` AR rounds, then one drafted round."""
    return [0] * stretch + [draft_width]


def pass_stats(times: dict[int, list[float]], stretch: int, draft_width: int) -> dict[str, float]:
    """One repetition's numbers from time_rounds' {width: [ms per round]} over the stretch sequence."""
    w0, drafted = times.get(0, []), times.get(draft_width, [])
    every = w0 + drafted
    return {"w0_mean": statistics.fmean(w0), "w0_median": statistics.median(w0),
            "draft_median": statistics.median(drafted), "stretch_mean": statistics.fmean(every)}


def summarize(samples: dict[int, dict[str, list[float]]]) -> dict:
    """Per c: spread of every series, and the ratios of the medians the verdict reads."""
    from toolkit.benchmark.projection import spread

    out = {}
    for c, series in samples.items():
        med = {k: statistics.median(v) for k, v in series.items() if v}
        row = {"spread": {k: spread(v) for k, v in series.items()}}
        if "ar" in med and "today_w0_mean" in med and "cut_w0_mean" in med:
            row.update(today_w0_over_ar=med["today_w0_mean"] / med["ar"], cut_w0_over_ar=med["cut_w0_mean"] / med["ar"],
                       cut_over_today_stretch=med["cut_stretch_mean"] / med["today_stretch_mean"],
                       catch_up_ms=med["cut_draft_median"] - med["today_draft_median"],
                       cut_within_5pct_of_ar=med["cut_w0_mean"] <= 1.05 * med["ar"])
        out[str(c)] = row
    return out


def time_variants(run, be, a) -> dict:
    """`a.warmup` untimed passes (the first meets every shape cold), then the interleaved repetitions; partial
    results saved after each."""
    from toolkit.exl3.options import Exl3Options
    from toolkit.exl3.calibrate import time_rounds

    seq = stretch_widths(a.stretch, a.draft_width)
    keys = ["ar"] + [f"{v}_{k}" for v in ("today", "cut") for k in ("w0_mean", "w0_median", "draft_median", "stretch_mean")]
    samples = {c: {k: [] for k in keys} for c in a.concurrency}
    out = run.results.setdefault("ar_rounds", {})

    def one_pass(rep: int) -> dict[int, dict[str, float]]:
        """Per c: AR, then today's and the cut variant (alternating which goes first), one sample per key."""
        got = {}
        for c in a.concurrency:
            be.set_options(Exl3Options())
            ar = time_rounds(be, c, [0], reps=a.passes * len(seq), context=a.context, speculative=False)[0]
            got[c] = {"ar": statistics.fmean(ar)}
            for v in ("today", "cut") if rep % 2 == 0 else ("cut", "today"):
                be.set_options(Exl3Options(defer_draft_kv=v == "cut"))
                st = pass_stats(time_rounds(be, c, seq, reps=a.passes, context=a.context), a.stretch, a.draft_width)
                got[c].update({f"{v}_{k}": ms for k, ms in st.items()})
        be.set_options(Exl3Options())
        return got

    warm_up(run, out, a.warmup, one_pass)
    reps = Repetitions(run, a.reps, a.reserve_s)
    for rep in reps:
        for c, row in one_pass(rep).items():
            for k, ms in row.items():
                samples[c][k].append(ms)
        rep_s = reps.lap()
        out.update(reps_done=rep + 1, rep_seconds=round(rep_s, 1), stretch=a.stretch, draft_width=a.draft_width,
                   context=a.context, concurrency=list(a.concurrency), cells=summarize(samples))
        c1 = samples[min(a.concurrency)]
        run.log(f"repetition {rep + 1}: {rep_s:.0f} s; c={min(a.concurrency)}: AR {c1['ar'][-1]:.2f} ms, w=0 today "
                f"{c1['today_w0_mean'][-1]:.2f}, cut {c1['cut_w0_mean'][-1]:.2f} ms")
        run.save()
    return samples


def forced_pattern(be, widths: list[int]):
    """A BatchPolicy that verifies widths[k % len] in round k (AR stretches and drafted rounds, as timed)."""
    from toolkit.policy.batch import BatchPolicy
    from toolkit.policy.policy import CostTable

    class Pattern(BatchPolicy):
        k = -1

        def width(self):
            self.k += 1
            return widths[self.k % len(widths)]

    return Pattern(be.block_size, CostTable({1: {0: 1.0, 1: 1.0}}))


def greedy_check(be, a) -> dict:
    """Greedy tokens of AR, today and cut on dummy prompts at each checked c, and today's rounds vs the cut's."""
    from toolkit.runtime.backend import GenSettings
    from toolkit.exl3.options import Exl3Options
    from toolkit.exl3.calibrate import dummy_prompts

    seq = stretch_widths(a.stretch, a.draft_width)
    st = GenSettings(max_new_tokens=a.check_tokens, block_size=None, stop_ids=())
    out = {}
    for c in [c for c in a.check_concurrency if c <= max(a.concurrency)]:     # the cache is sized for those
        prompts = dummy_prompts(c, a.context, be.vocab_size)
        be.set_options(Exl3Options())
        ar = {i: [] for i in range(c)}
        for i, r in be.generate_many(prompts, st, speculative=False):
            ar[i] += r.tokens
        rounds = {}
        for v in ("today", "cut"):
            be.set_options(Exl3Options(defer_draft_kv=v == "cut"))
            per = {i: [] for i in range(c)}
            for i, r in be.decode_many(prompts, be._jobs(prompts, st), 0, forced_pattern(be, seq)):
                per[i].append((r.drafted, r.accepted, r.bonus))
            rounds[v] = per
        be.set_options(Exl3Options())
        toks = {v: {i: [t for d, n, b in rs for t in list(d[:n]) + [b]] for i, rs in per.items()} for v, per in rounds.items()}
        diff = sum(sum(x != y for x, y in zip(rounds["today"][i], rounds["cut"][i]))
                   + abs(len(rounds["today"][i]) - len(rounds["cut"][i])) for i in range(c))
        out[str(c)] = {"today_equals_ar": toks["today"] == ar, "cut_equals_ar": toks["cut"] == ar,
                       "cut_equals_today": toks["cut"] == toks["today"],
                       "rounds": sum(len(r) for r in rounds["cut"].values()), "rounds_differing": diff}
    return out


def run_ar(run, a) -> None:
    """Mode `ar` of experiments/speed.py: synthesise (or reuse) and load the real shape, time, check."""
    from experiments.harness import free_cuda
    from experiments.speed import load_shape, synth_pair

    run.step("synth", synth_pair, a.work, a.resynth, need_s=60)
    a.widths = stretch_widths(a.stretch, a.draft_width)          # load_shape sizes the cache from them
    be = run.step("load", load_shape, a, keep=False, need_s=30)
    if be is None:
        return
    try:
        run.step("timing", time_variants, run, be, a, keep=False)
        run.step("greedy", greedy_check, be, a, need_s=20)
    finally:
        free_cuda(be)
