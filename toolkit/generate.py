"""`python -m toolkit.generate`: decode one prompt speculatively (and optionally plain AR) and report the rounds.

With no --target/--draft it runs the trained tiny pair shipped with the package, on CPU; `--draft mtp` drafts with
the target's own MTP head instead of a DFlash drafter.
The --json output is a stable contract (docs/generate.md): tokens, text, rounds, tau, tok_s, and with
--compare-ar also ar_tokens, ar_tok_s, speedup (null, with speedup_reason, when fewer than 1 round in 10
drafted over all repetitions), speedup_spread, lossless, lockstep. --block-size auto (the default) lets the drafting policy pick each
round's verify width (0 = a plain AR round); a number N verifies N-1 drafts every round. With --compare-ar the
speculative and AR decodes run --reps times each, in lockstep on a CPU (one round of each in turn), one after the
other on a GPU; the speedup is the ratio of the median pair, with the min-max of all (benchmark/ratio.py), and
the tokens, rounds and tok/s reported are that pair's.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from .core import checks
from .core.cli import entry, like, option
from .core.cli import run as run_cli_options
from .core.errors import ToolkitError
from .runtime.backend import Backend, GenSettings
from .benchmark import lockstep, ratio
from .runtime.events import Round, Speedup, Summary, ar_verdict, summarize, tokens_of
from .runtime.factory import load_backend
from .runtime.registry import BACKENDS
from .runtime.placement import DRAFT_HELP, SPLIT_HELP, TP_HELP, GpuSplit


def load(backend: str, target: str | None, draft: str | None, device: str | None = None,
         split: GpuSplit | None = None) -> Backend:
    """The named backend over the given folders, or over the shipped tiny pair when none are given."""
    if target is None and draft is None:
        from .assets.pairs import tiny_pair

        target, draft = (str(p) for p in tiny_pair())
    elif target is None:
        raise ToolkitError("--draft needs --target (the drafter uses the target's embeddings and lm_head)")
    return load_backend(backend, target, draft, device=device or "cpu", split=split)


def timed(backend: Backend, ids: list[int], settings: GenSettings, speculative: bool) -> tuple[list[Round], float]:
    t0 = time.perf_counter()
    rounds = list(backend.generate(ids, settings, speculative=speculative))
    return rounds, time.perf_counter() - t0


Runs = list[tuple[list[Round], float]]      # (rounds, seconds) of each run, in order


def decode_runs(be: Backend, ids: list[int], settings: GenSettings, compare_ar: bool, reps: int,
                paired: bool) -> tuple[Runs, Runs]:
    """The speculative runs and (with compare_ar) the AR runs: `reps` pairs, each in lockstep (one round of each in
    turn, timed inside each side's rounds) when `paired`, else one run after the other."""
    if compare_ar and paired:
        pairs = [lockstep.timed_lockstep({"spec": be.generate(ids, settings),
                                          "ar": be.generate(ids, settings, speculative=False)}) for _ in range(reps)]
        return [(r["spec"], t["spec"]) for r, t in pairs], [(r["ar"], t["ar"]) for r, t in pairs]
    spec, ar = [timed(be, ids, settings, speculative=True)], []
    for k in range(reps if compare_ar else 0):
        if k:
            spec.append(timed(be, ids, settings, speculative=True))
        ar.append(timed(be, ids, settings, speculative=False))
    return spec, ar


def run(be: Backend, prompt: str, settings: GenSettings, compare_ar: bool, system: str | None,
        raw: bool, reps: int = 1, paired: bool = False) -> tuple[dict, Summary, int]:
    """Decode the prompt speculatively (and with compare_ar plain AR too, `reps` pairs, in lockstep when `paired`);
    the JSON-contract dict, its summary and the index of the repetition both describe: the pair the speedup is the
    ratio of (benchmark/ratio.py: the median one), the first without compare_ar."""
    ids = be.raw_encode(prompt) if raw else be.encode(prompt, system=system)
    be.check_prompts([ids], settings.max_new_tokens)       # the real length, not the warm-up's 4 tokens
    be.warm_up(ids, settings, (True, False) if compare_ar else (True,))   # outside the clock: a fair comparison
    spec_runs, ar_runs = decode_runs(be, ids, settings, compare_ar, reps, paired)
    speed = compare_speed(spec_runs, ar_runs) if compare_ar else None
    k = pair_of(spec_runs, ar_runs) if compare_ar else 0
    rounds, secs = spec_runs[k]
    toks = tokens_of(rounds)
    s = summarize(rounds, secs)
    result = {
        "backend": be.name, "prompt_tokens": len(ids),
        "block_size": "auto" if settings.auto else settings.fixed_block(be.block_size),
        "tokens": toks, "text": be.decode(toks), "rounds": [r.to_json() for r in rounds],
        "tau": s.tau, "accept_per_position": s.accept_per_position, "tok_s": s.tok_s, "seconds": secs,
        "costs": be.cost_source() if settings.auto else None,
    }
    if compare_ar:
        result.update(compare(spec_runs, ar_runs, paired, speed, k))
    return result, s, k


def rate(run: tuple[list[Round], float]) -> float:
    return len(tokens_of(run[0])) / run[1] if run[1] > 0 else 0.0


def compare_speed(spec_runs: Runs, ar_runs: Runs) -> Speedup:
    """The speedup by the one ratio rule (benchmark/ratio.py): drafted rounds counted over every repetition, the
    ratio of the median pair."""
    why = ratio.too_few_drafted([r for rounds, _ in spec_runs for r in rounds], len(spec_runs))
    return ratio.paired([rate(r) for r in spec_runs], [rate(r) for r in ar_runs], why)


def pair_of(spec_runs: Runs, ar_runs: Runs) -> int:
    """The repetition reported: the one with the median spec/AR ratio (the first when none has a ratio)."""
    k = ratio.median_pair([rate(r) for r in spec_runs], [rate(r) for r in ar_runs])
    return 0 if k is None else k


def compare(spec_runs: Runs, ar_runs: Runs, paired: bool, speed: Speedup, k: int) -> dict:
    """The AR keys of the JSON contract, of repetition `k` beside the speedup; lossless over every run."""
    ar = tokens_of(ar_runs[k][0])
    return {"ar_tokens": ar, "ar_tok_s": rate(ar_runs[k]), "ar_seconds": ar_runs[k][1], **speed.to_json(),
            "tok_s_reps": [rate(r) for r in spec_runs], "ar_tok_s_reps": [rate(r) for r in ar_runs],
            "lossless": all(tokens_of(rounds) == ar for rounds, _ in spec_runs + ar_runs), "lockstep": paired}


def generate(o: GenerateOptions) -> dict:
    """Run one prompt with the options `o` (those of the command line); returns the JSON-contract dict (and prints
    it, or a readable summary)."""
    prompt, block_size, device, compare_ar = o.prompt, o.block_size, o.device, o.compare_ar
    if not prompt.strip():
        raise ToolkitError("--prompt is empty")
    try:
        settings = GenSettings(max_new_tokens=o.max_new_tokens, temperature=o.temperature, seed=o.seed,
                               block_size=block_size)
    except ValueError as e:
        raise ToolkitError(str(e)) from None
    checks.whole("reps", o.reps, 1, 10**6)
    if o.retime_costs and not settings.auto:
        raise ToolkitError(f"--retime-costs applies only with --block-size auto: block size {block_size} times no "
                           "round costs")
    if device is not None:
        checks.device("device", device)            # `--device cuda` without a GPU: refused before any loading
    be = load(o.backend, o.target, o.draft, device, GpuSplit.of(o.gpu_split, o.tensor_parallel, o.draft_device))
    if be.book is not None:
        be.book.retime = o.retime_costs
    paired = not be.caps.gpu_only and (device or "cpu") == "cpu"  # a CPU: load moves a run more than drafting does
    try:
        result, s, k = run(be, prompt, settings, compare_ar, o.system, o.raw, o.reps, paired)
    finally:
        be.close()
    if o.json_out:
        print(json.dumps(result))
    else:
        print(result["text"])
        steps = sum(1 for r in result["rounds"] if not r["prefill"])
        reps_n = len(result.get("tok_s_reps") or [1])
        which = (f" (both of repetition {k + 1} of {reps_n}, the pair the speedup is the ratio of)"
                 if compare_ar and reps_n > 1 else "")
        line = (f"\n[{be.name}] {len(result['tokens'])} tokens, {s.rounds} speculative round{'s' if s.rounds != 1 else ''}"
                + (f" of {steps} (block auto; the rest plain AR)" if settings.auto else "")
                + f", tau {s.tau:.2f}, {s.tok_s:.1f} tok/s")
        if compare_ar:
            line += (f"; AR {result['ar_tok_s']:.1f} tok/s{which}; speedup {speed_text(result)}; "
                     f"lossless {result['lossless']}")
        verdict = ar_verdict(steps - s.rounds, s.rounds) if settings.auto else ""
        costs = f"\n[{be.name}] round costs: {result['costs']} (--retime-costs times them again)" if result["costs"] else ""
        print(line + costs + (f"\n[{be.name}] {verdict}" if verdict else ""), file=sys.stderr)
    return result


def speed_text(result: dict) -> str:
    """The speedup of a --compare-ar result in words: the median ratio with its spread, or why there is none."""
    if result["speedup"] is None:
        return f"none ({result['speedup_reason']})"
    sp, how = result.get("speedup_spread"), "lockstep" if result.get("lockstep") else "alternating"
    if not sp:
        return f"{result['speedup']:.2f}x (one {how} run of each: no spread measured; --reps 3 or more measures it)"
    return f"{result['speedup']:.2f}x (the median of {sp['n']} {how} pairs; {sp['min']:.2f}-{sp['max']:.2f}x over them)"


@dataclass
class GenerateOptions:
    prompt: str = option(help="user message (goes through the chat template when there is one)")
    target: str | None = option(None, "target model folder (default: the shipped tiny pair)")
    draft: str | None = option(None, "DFlash drafter folder in the upstream layout, or mtp: the target's own "
                               "multi-token-prediction head (Qwen3.5 / Qwen3.6 ship one)")
    max_new_tokens: int = like(GenSettings, "max_new_tokens")
    block_size: str = option("auto", "auto (default): a measured policy picks each round's verify width, plain AR where "
                             "drafting does not pay; N >= 2: every round verifies N-1 drafts (cut to the drafter's block)",
                             metavar="auto|N")
    temperature: float = like(GenSettings, "temperature", help="0 = greedy (default)")
    seed: int = like(GenSettings, "seed")
    backend: str = option("torch", choices=list(BACKENDS))
    compare_ar: bool = option(False, "also decode plain AR on the same target; report speedup and lossless")
    reps: int = option(3, "with --compare-ar: this many speculative and AR decodes, in pairs (on a CPU each pair in "
                       "lockstep: one round of each in turn); the speedup is the ratio of the pair with the median one, "
                       "printed with that pair's tok/s and the min-max of all (default 3)", lo=1, hi=10**6)
    system: str | None = option(None, "system prompt")
    raw: bool = option(False, "tokenize the prompt as is, without the chat template")
    device: str | None = option(None, "torch device for the torch backend (default cpu)", kind="device")
    json_out: bool = option(False, "print one JSON object (the documented contract)", flag="--json")
    gpu_split: str | None = option(None, SPLIT_HELP, metavar="auto|GB,GB,...")
    tensor_parallel: bool = option(False, TP_HELP)
    draft_device: int = option(0, DRAFT_HELP, metavar="N", lo=0, hi=1023)
    retime_costs: bool = option(False, "with --block-size auto: time the policy's round costs again instead of reading "
                                "them from the cost cache (a table timed under other load is also corrected as it runs)")


def main(argv: list[str] | None = None) -> None:
    run_cli_options(lambda **kw: generate(GenerateOptions(**kw)), GenerateOptions, argv, "python -m toolkit.generate",
                    __doc__.split("\n\n")[0], "Example: python -m toolkit.generate --prompt 'Return the' --compare-ar --json\n\n"
                    "Outputs: none; it prints to stdout (the output policy of the commands that write: docs/outputs.md).")


if __name__ == "__main__":
    entry(main)
