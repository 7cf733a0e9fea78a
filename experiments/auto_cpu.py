"""block_size auto against plain AR on the torch backend, on a CPU: the tiny pair and the SmolLM2 demo pair.

Each comparison runs two decoders of the same prompt in lockstep, one round of each in turn, so that the load
of a shared machine falls on both alike; the result is tokens/s of the mode over tokens/s of plain AR on the
same answer (greedy, identical tokens checked). Modes:
- `auto`: `TorchBackend.generate` with block_size "auto" (the drafting policy, its cost table timed once and
  cached); with --cold every answer starts from a fresh policy after the app's 4-token warm-up, as the app's
  first turn does (later turns keep the round costs learnt), else one policy learns over all answers as a
  long-running server's does;
- `fixedN`: every round verifies N-1 drafts.
Runs on a CPU (not on the device): `python -m experiments.auto_cpu --pair smollm2 --threads 1` (`--poison 0.2`:
from a cached table whose drafting costs read 5x too cheap); writes `$OUT/auto_cpu.json` (default /tmp/out).

`--app` measures the app's own ratio against this lockstep comparison instead, interleaved on one backend: for
each prompt and repetition one chat turn through the app's handler, then one comparison of the same prompt and
mode (one of --modes), e.g. `python -m experiments.auto_cpu --app --modes fixed16 --reps 3`; writes
`$OUT/app_cpu.json`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from experiments.harness import Run

PROMPTS = {"tiny": ["pathlib.Path", "shutil.copy", "json.dumps", "textwrap.wrap"],             # the app's examples
           "smollm2": ["Explain speculative decoding to a ten-year-old in three sentences.",
                       "Write a Python function that checks whether a string is a palindrome.",
                       "List five facts about the Moon."]}


def load_pair(pair: str):
    from toolkit.runtime.torch_backend import TorchBackend

    if pair == "tiny":
        from toolkit.assets.pairs import tiny_pair

        return TorchBackend.from_dirs(*tiny_pair())
    from toolkit.assets.smollm2 import default_pair

    return TorchBackend.from_dirs(*default_pair())


def decoder(be, mode: str, ids: list[int], max_new: int, cold: bool):
    """The Round generator of one mode ("ar", "auto" or "fixedN")."""
    from toolkit.runtime.backend import GenSettings

    s = GenSettings(max_new_tokens=max_new)
    if mode == "ar":
        return be.generate(ids, s, speculative=False)
    if mode == "auto":
        if cold:
            be.book.policies.clear()
            be.warm_up(be.encode("Hello"), modes=(True,))                   # the app's warm-up (it learns nothing)
        return be.generate(ids, s)
    if mode.startswith("fixed") and mode[5:].isdigit():
        return be.generate(ids, GenSettings(max_new_tokens=max_new, block_size=int(mode[5:])))
    raise ValueError(f"unknown mode {mode!r}")


def lockstep(be, mode: str, ids: list[int], max_new: int, cold: bool) -> dict:
    """Both decoders one round each in turn; seconds spent inside each, their tokens, the mode's widths."""
    from toolkit.runtime.events import tokens_of

    gens = {"ar": decoder(be, "ar", ids, max_new, cold), mode: decoder(be, mode, ids, max_new, cold)}
    secs, rounds, live = {k: 0.0 for k in gens}, {k: [] for k in gens}, list(gens)
    while live:
        for k in list(live):
            t0 = time.perf_counter()
            try:
                rounds[k].append(next(gens[k]))
            except StopIteration:
                live.remove(k)
            finally:
                secs[k] += time.perf_counter() - t0
    toks = tokens_of(rounds["ar"])
    if tokens_of(rounds[mode]) != toks:
        raise AssertionError(f"{mode} differs from AR under greedy")
    return {"tokens": len(toks), "speed_vs_ar": secs["ar"] / secs[mode], "ar_tok_s": len(toks) / secs["ar"],
            "widths": [len(r.drafted) for r in rounds[mode] if not r.prefill]}


def compare(be, pair: str, modes: list[str], reps: int, max_new: int, cold: bool) -> dict:
    out = {}
    for p in PROMPTS[pair]:
        ids = be.encode(p)
        for m in modes:
            runs = [lockstep(be, m, ids, max_new, cold) for _ in range(reps)]
            ratios = [r["speed_vs_ar"] for r in runs]
            out.setdefault(p, {})[m] = {"median": round(statistics.median(ratios), 3), "runs": [round(x, 3) for x in ratios],
                                        "tokens": runs[-1]["tokens"], "last_widths": runs[-1]["widths"]}
            print(f"{p[:36]!r:40s} {m:8s} x{statistics.median(ratios):.3f} vs AR (runs {', '.join(f'{x:.3f}' for x in ratios)})",
                  flush=True)
    return out


def app_turn(handler, prompt: str, block: int | str, max_new: int) -> dict:
    """One chat turn through the app's handler, as the page sends it; its result JSON."""
    last = None
    for out in handler.respond(prompt, [], block, max_new, 0.0, 0, "", False):
        last = out
    return last[-1]


def against_app(be, pair: str, block: int | str, reps: int, max_new: int) -> dict:
    """`--app`: per prompt, a chat turn through the app's handler (`ChatHandler.respond` as the page calls it: both
    runs in lockstep, every turn from the start-up policy state) and a lockstep comparison of the same prompt and
    block size, back to back so both see the same load; the app's `speedup` against the comparison's `speed_vs_ar`."""
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
            exp.append(lockstep(be, mode, be.encode(p), max_new, cold=False)["speed_vs_ar"])
        med = [statistics.median(x) if None not in x else None for x in (app, exp)]
        out[p] = {"app": [None if x is None else round(x, 3) for x in app], "experiment": [round(x, 3) for x in exp],
                  "app_median": med[0] and round(med[0], 3), "experiment_median": round(med[1], 3),
                  "app_over_experiment": med[0] and round(med[0] / med[1], 3)}
        print(f"{p[:40]!r:44s} app {out[p]['app_median']} experiment {out[p]['experiment_median']} "
              f"(app {out[p]['app']}, experiment {out[p]['experiment']})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.auto_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=sorted(PROMPTS), default="smollm2")
    ap.add_argument("--modes", default="auto,fixed16", help="comma-separated: auto, fixedN")
    ap.add_argument("--reps", type=int, default=3, help="lockstep runs per prompt and mode (median reported)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="the app's default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as the app runs)")
    ap.add_argument("--cold", action="store_true", help="a fresh policy for every auto answer (the app's first turn)")
    ap.add_argument("--poison", type=float, default=None, metavar="F",
                    help="decode from the cached table with every drafting cost times F (a table timed under other "
                         "load), corrected by observed rounds as a cached table is")
    ap.add_argument("--app", action="store_true", help="the app's own ratio against the lockstep comparison of "
                    "the same prompt, interleaved (one mode)")
    a = ap.parse_args(argv)
    if any(m != "auto" and not (m.startswith("fixed") and m[5:].isdigit()) for m in a.modes.split(",")):
        ap.error(f"--modes {a.modes}: each one auto or fixedN")
    if a.app and ("," in a.modes or a.cold or a.poison is not None):
        ap.error("--app takes one mode in --modes, and neither --cold nor --poison")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.app:
        run = Run("app_cpu.json", section="results")
        block = "auto" if a.modes == "auto" else int(a.modes[5:])
        run.results.update(pair=a.pair, block=str(block), threads=torch.get_num_threads(),
                           max_new_tokens=a.max_new_tokens, reps=a.reps)
        be = run.step("load", load_pair, a.pair, keep=False)
        if be is not None:
            run.step("compare", against_app, be, a.pair, block, a.reps, a.max_new_tokens)
        return run.finish()
    run = Run("auto_cpu.json", section="results")
    run.results.update(pair=a.pair, threads=torch.get_num_threads(), cold=a.cold, max_new_tokens=a.max_new_tokens)
    be = run.step("load", load_pair, a.pair, keep=False)
    if be is None:
        return run.finish()
    run.step("cost_table", lambda: {str(w): round(t, 2) for w, t in be.book.table().ms[1].items()})
    if a.poison is not None:
        from toolkit.costs.table import CostTable

        timed = be.book.table().ms[1]
        be.book.give(CostTable({1: {w: t * (a.poison if w else 1.0) for w, t in timed.items()}}, source="poisoned"))
        run.results["poison"] = a.poison
    run.step("compare", compare, be, a.pair, a.modes.split(","), a.reps, a.max_new_tokens, a.cold)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
