"""Why the drafting policy's calibration table costs ~2x the rounds decoding sees (issue 16, SmolLM2 pair).

Session 12's pair bench: at c=1 the table said AR 30.2 ms and w=12-15 48.2 ms, decoding's rounds cost 14.2 ms
(AR) and 17-18 ms (w=12-15). The table's timer (exl3_calibrate.time_rounds) differs from decoding in four ways;
this times each alone, in one process, interleaved over repetitions, at the same widths:

- `table`: the timer as calibrate ran it up to TABLE_VERSION 2 (exl3_calibrate.TABLE: dummy prompts, one round per
  width in turn, synchronized);
- `stretch`: dummy prompts, 4 rounds in a row per width, the first 2 untimed;
- `text`: the built-in chat and code text instead of the dummy ids (drafts accepted about as in decoding);
- `nosync`: the table without the device synchronize around each iterate();
- `recipe`: all three together, exl3_calibrate.DECODE_LIKE (the candidate for the backend's tables);
- `decode`: decoding's own rounds (experiments.switch_cost.run_schedule: one fixed width, held-out prompts).

Per (c, variant, width): median ms and mean tokens a job emitted per round. After
`python3 -m experiments.smol_device stage` on the same warm machine, carry [".device"]:

    source .device/on-device.sh && timeout 200 python -m experiments.calib_check      # writes $OUT/calib_check.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

from experiments.harness import Run
from experiments.switch_cost import open_pair, pair_args, run_schedule

WIDTHS = (0, 3, 7, 15)
VARIANTS = ("table", "stretch", "text", "nosync", "recipe", "decode")


def recipes() -> dict:
    """The calibration of each timer variant (exl3_calibrate.Calibration)."""
    from toolkit.exl3.calibrate import DECODE_LIKE, TABLE, Calibration

    return {"table": TABLE, "stretch": Calibration(stretch=4, settle=2, reps=3, warm=1),
            "text": Calibration(text=True), "nosync": Calibration(sync=False), "recipe": DECODE_LIKE}


def time_variant(be, name: str, c: int, texts: list[list[int]], rounds: int) -> dict[int, tuple[list[float], list[float]]]:
    """{width: (ms per timed round, tokens a job emitted per round)} of one variant at c jobs."""
    from toolkit.exl3.calibrate import time_calibration

    if name == "decode":
        out = {}
        for w in WIDTHS:
            got = run_schedule(be, texts[:c], [w] * (rounds + 6), True)[6:]
            out[w] = ([ms for _, ms, _ in got], [g for _, _, g in got])
        return out
    emitted: dict[int, list[float]] = {}
    times = time_calibration(be, c, WIDTHS, recipes()[name], emitted=emitted)
    return {w: (times[w], emitted.get(w, [])) for w in WIDTHS}


def summarize(samples: dict) -> dict:
    return {c: {v: {w: {"ms": round(statistics.median(ms), 2), "ms_q1": round(statistics.quantiles(ms, n=4)[0], 2)
                        if len(ms) > 1 else None, "rounds": len(ms),
                        "tokens": round(statistics.mean(tk), 2) if tk else None}
                    for w, (ms, tk) in per.items() if ms}
                for v, per in d.items()} for c, d in samples.items()}


def measure(run: Run, a) -> dict:
    be, held = open_pair(a, max(a.concurrency))
    texts = [be.encode(t) for t in held]
    samples: dict = {f"c{c}": {v: {w: ([], []) for w in WIDTHS} for v in VARIANTS} for c in a.concurrency}
    try:
        for rep in range(a.reps):
            order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
            for c in a.concurrency:
                for v in order:
                    for w, (ms, tk) in time_variant(be, v, c, texts[rep:] + texts[:rep], a.rounds).items():
                        samples[f"c{c}"][v][w][0].extend(ms)
                        samples[f"c{c}"][v][w][1].extend(tk)
            run.log(f"repetition {rep + 1} done")
            run.results["summary"] = summarize(samples)
            run.save()
            if run.left() < 30:
                break
    finally:
        be.close()
    return run.results["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.calib_check", description=__doc__.split("\n\n")[0])
    pair_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=12, help="timed decoding rounds per width (default 12)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=170.0)
    a = p.parse_args(argv)
    run = Run("calib_check.json", budget_s=a.budget_s)
    run.step("measure", measure, run, a)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
