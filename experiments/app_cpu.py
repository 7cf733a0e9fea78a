"""The app's own ratio on a CPU against the lockstep experiment's, on the same backend, interleaved.

For each of the app's example prompts (SmolLM2 pair) and each repetition, one chat turn through the app's handler
(`ChatHandler.respond` as the page calls it: the two runs in lockstep, every turn from the start-up policy state)
and one `experiments.auto_cpu` lockstep comparison of the same prompt and block size, back to back, so both see
the same load. The app's value is the turn's `speedup` (speculative tok/s over AR tok/s); the experiment's its
`speed_vs_ar`. Runs on a CPU, not the device:
`python -m experiments.app_cpu --block 16 --reps 3` (`--pair tiny`, `--threads N`); writes `$OUT/app_cpu.json`
(default /tmp/out).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from experiments.auto_cpu import PROMPTS, load_pair
from experiments.auto_cpu import lockstep as experiment
from experiments.harness import Run


def app_turn(handler, prompt: str, block: int | str, max_new: int) -> dict:
    """One chat turn through the app's handler, as the page sends it; its result JSON."""
    last = None
    for out in handler.respond(prompt, [], block, max_new, 0.0, 0, "", False):
        last = out
    return last[-1]


def compare(be, pair: str, block: str, reps: int, max_new: int) -> dict:
    from toolkit.app.handlers import ChatHandler
    from toolkit.app.models import Loaded
    from toolkit.app.policy_view import PolicyStart

    be.warm_up(be.encode("Hello"))                     # the app's start-up; every turn starts from what it left
    handler = ChatHandler(Loaded(be, backend_name="torch", device="cpu", policy_start=PolicyStart(be)))
    mode = "auto" if block == "auto" else f"fixed{block}"
    out = {}
    for p in PROMPTS[pair]:
        app, exp = [], []
        for _ in range(reps):
            res = app_turn(handler, p, block, max_new)
            if not res["lossless"]:
                raise AssertionError(f"the app's turn differs from AR on {p!r}")
            app.append(res["speedup"])
            exp.append(experiment(be, mode, be.encode(p), max_new, cold=False)["speed_vs_ar"])
        med = [statistics.median(x) if None not in x else None for x in (app, exp)]
        out[p] = {"app": [None if x is None else round(x, 3) for x in app], "experiment": [round(x, 3) for x in exp],
                  "app_median": med[0] and round(med[0], 3), "experiment_median": round(med[1], 3),
                  "app_over_experiment": med[0] and round(med[0] / med[1], 3)}
        print(f"{p[:40]!r:44s} app {out[p]['app_median']} experiment {out[p]['experiment_median']} "
              f"(app {out[p]['app']}, experiment {out[p]['experiment']})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.app_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=sorted(PROMPTS), default="smollm2")
    ap.add_argument("--block", default="16", help="auto or a fixed block size (default 16)")
    ap.add_argument("--reps", type=int, default=3, help="app turns and experiment runs per prompt, interleaved")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="the app's default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as the app runs)")
    a = ap.parse_args(argv)
    if a.block != "auto" and not a.block.isdigit():
        ap.error(f"--block {a.block}: auto or an integer")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    block = a.block if a.block == "auto" else int(a.block)
    run = Run("app_cpu.json", section="results")
    run.results.update(pair=a.pair, block=a.block, threads=torch.get_num_threads(), max_new_tokens=a.max_new_tokens,
                       reps=a.reps)
    be = run.step("load", load_pair, a.pair, keep=False)
    if be is None:
        return run.finish()
    run.step("compare", compare, be, a.pair, block, a.reps, a.max_new_tokens)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
