"""The drafting policy's replay (tests/replay.py, tests/slow/test_policy_replay.py): its inputs, made on a CPU, and its table.

- `lengths`: decodes the SmolLM2 pair's held-out prompts greedily on the CPU (torch backend, fp32) in the pair
  bench's order (`--limit`), and at every answer position records the drafter's full-width accepted length L:
  how many of its B-1 proposed tokens equal the target's next ones. Greedy output does not depend on the widths
  verified, so one decode gives every position.
- `costs`: turns a `speed pair --trace` file and its bench.json into round costs per (jobs, width), the cost per
  emitted token, the prefill ms, the calibration table the bench's `auto` cells started from, and the device's
  noise in time: every decoding round's ms over its (jobs, width) steady median, in the order the bench ran them
  (a slow stretch of the device slows every width for a while; tests/replay.py can play it back over the steady
  medians: the medians with the card's slow stretches taken out, so a width used mostly in one is not slowed twice).
- `table`: `auto`, exllamav3 1.6.5's own window and `auto` without each of its mechanisms over AR and every
  calibrated fixed width, on every committed trace (the results page's table, as markdown); `--write` refreshes its
  tracked cache (tests/replay_cache.py) and full table, and prints the results page's summary.

    python -m experiments.policy_replay lengths --limit 8 --out /tmp/replay/lengths.json
    python -m experiments.policy_replay costs experiments/results/traces/pair_1206-1042_trace.jsonl.gz \
        --bench experiments/results/traces/pair_1206-1042_bench.json --out tests/data/replay/costs_h100_1206-1042.json.gz
    python -m experiments.policy_replay table --seeds 16 --reps 10

The CPU drafter is the BF16 drafter in fp32, not the device's EXL3 6 bpw one, so the lengths are close to the
device's, not equal; new shapes' CUDA graph captures are not modelled (every shape is warm).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from experiments.round_trace import read as read_trace

MIN_ROUNDS = 5        # traced rounds a (jobs, width) needs to stand for itself
SWITCH_MS = 0.25      # a round at another width than the one before: median excess 0.06-0.46 ms in the s20/s21 traces


def draft_scores(steps, token: int, positions: int) -> tuple[list[int], list[float]]:
    """The drafter's proposal after `token` (as TorchSteps.draft_block) and each position's winning logit, the
    score exllamav3 1.6.5 calibrates its dynamic draft window on (Model.lm_head_argmax's draft_conf)."""
    import torch

    steps.flush()
    with torch.no_grad():
        emb = steps.target.get_input_embeddings().weight
        h = steps.drafter.draft_hidden(steps.draft_cache, torch.tensor([token], device=emb.device), emb)
        conf, ids = steps.target.get_output_embeddings()(h[:, 1:1 + positions].to(emb.dtype))[0].max(-1)
    return ids.tolist(), conf.float().tolist()


def full_lengths(steps, prompt_ids: list[int], answer: list[int], positions: int) -> tuple[list[int], list[list[float]]]:
    """L at every answer position p (the drafter's proposal after answer[p], matched against answer[p+1:]) and
    the proposal's per-position scores (draft_scores)."""
    from toolkit.runtime.loop import accepted_prefix

    steps.prefill(prompt_ids)
    out, scores = [], []
    for p in range(len(answer) - 1):
        truth = answer[p + 1:p + 1 + positions]
        ids, conf = draft_scores(steps, answer[p], positions)
        out.append(accepted_prefix(ids[:len(truth)], truth))
        scores.append([round(x, 2) for x in conf])
        steps.verify([answer[p]])
        steps.accept(1)
    return out, scores


def lengths(out: Path, limit: int = 4, max_new_tokens: int = 96, target: Path | None = None,
            draft: Path | None = None, prompts: Path | None = None, force: bool = False) -> dict:
    """Greedy answers and full-width lengths of the pair's prompts (the demo pair and its drafter's held-out
    prompts by default), written to `out` once complete; an existing `out` is replaced only with `force`."""
    import tempfile

    import torch

    from experiments.pair_mode import heldout_jsonl
    from toolkit.assets.prompts import load_prompts, mixed
    from toolkit.assets.smollm2 import default_pair
    from toolkit.runtime.backend import GenSettings
    from toolkit.runtime.torch_backend import TorchBackend, TorchSteps

    if out.exists() and not force:
        raise ValueError(f"{out} exists (pass --force to replace it)")
    if limit < 1 or max_new_tokens < 2:
        raise ValueError("--limit must be >= 1 and --max-new-tokens >= 2")
    torch.set_num_threads(2)
    if target is None or draft is None:
        target, draft = default_pair()
    be = TorchBackend.from_dirs(target, draft)
    with tempfile.TemporaryDirectory() as tmp:
        if prompts is None:
            prompts = heldout_jsonl(Path(draft) / "heldout.json", Path(tmp) / "heldout.jsonl")
        items = mixed(load_prompts(prompts), limit)          # the pair bench's order (toolkit/bench.py)
    rows = []
    for i, item in enumerate(items):
        ids = be.encode(item.text)
        rounds = list(be.generate(ids, GenSettings(max_new_tokens=max_new_tokens), speculative=False))
        answer = [t for r in rounds for t in r.tokens]
        L, conf = full_lengths(TorchSteps(be.target, be.drafter), ids, answer, be.block_size - 1)
        rows.append({"category": item.category, "answer": answer, "lengths": L, "conf": conf})
        print(f"prompt {i + 1}/{len(items)}: {len(answer)} tokens, mean L {statistics.mean(L or [0]):.2f}", file=sys.stderr)
    res = {"block_size": be.block_size, "max_new_tokens": max_new_tokens, "limit": limit, "prompts": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    try:
        part.write_text(json.dumps(res) + "\n")
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)                  # a full disk leaves no half-written file
    return res


# -- costs from a trace -----------------------------------------------------------------------------------------

def costs(trace: Path, bench: Path, out: Path, keep: int = 64, force: bool = False) -> dict:
    """The pair bench's round costs in the replay's form (tests/replay.py): per (jobs, width) up to `keep` traced
    decoding rounds of the timed cells (the bench's --max-new-tokens, not its short warm-up wave), the cost per
    emitted token beyond one per job (least squares over the fixed-width cells), the B=8 cells' prefill ms per
    concurrency, and the calibration table `auto` started from."""
    import gzip
    import random

    if out.exists() and not force:
        raise ValueError(f"{out} exists (pass --force to replace it)")
    run = json.loads(bench.read_text())
    timed = f"/n{run['max_new_tokens']}"
    by: dict[tuple[int, int], list[float]] = defaultdict(list)
    order: list[tuple[int, int, float]] = []
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    prefill: dict[int, list[float]] = defaultdict(list)
    for r in read_trace(trace):
        if not r["cell"].endswith(timed) or r["ms"] >= 100 and r["jobs"]:
            continue
        if r["jobs"] and r["emitted"] >= r["jobs"]:
            by[(r["jobs"], r["w"])].append(r["ms"])
            order.append((r["jobs"], r["w"], r["ms"]))
            if not r["cell"].startswith(("auto", "ar")):
                groups[(r["cell"], r["jobs"])].append((r["emitted"], r["ms"]))
        elif not r["jobs"] and r["cell"].startswith("8/"):
            prefill[int(r["cell"].split("/")[1][1:])].append(r["ms"])
    med = steady_medians(order)
    rng = random.Random(0)
    cell = next(c for c in run["cells"] if c["block_size"] == "auto" and "costs" in c)
    res = {"trace": trace.name,
           "rounds": {f"{j},{w}": [round(x, 4) for x in (v if len(v) <= keep else rng.sample(v, keep))]
                      for (j, w), v in sorted(by.items())},
           "steady": {f"{j},{w}": round(med[(j, w)], 4) for j, w in sorted(by)},
           "per_token_ms": slope(groups.values()),
           "prefill_ms": {c: statistics.median(v) for c, v in sorted(prefill.items())},
           "start": cell["costs"]["start"],
           "noise": [round(ms / med[(j, w)], 3) for j, w, ms in order]}
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    try:
        part.write_bytes(gzip.compress(json.dumps(res).encode(), mtime=0))
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)
    return res


def steady_medians(order: list[tuple[int, int, float]], half: int = 64, passes: int = 3) -> dict[tuple[int, int], float]:
    """Each (jobs, width)'s median ms with the card's slow stretches taken out: a round's ms over the card's local
    pace (the median, over the `half` rounds either side in time, of each round's ms over its shape's median). A
    width used mostly during a slow stretch would otherwise read dear, and the replay's noise would slow it twice."""
    pace = [1.0] * len(order)                               # the first pass: plain medians
    for n in range(passes + 1):
        by: dict[tuple[int, int], list[float]] = defaultdict(list)
        for (j, w, ms), p in zip(order, pace):
            by[(j, w)].append(ms / p)
        med = {k: statistics.median(v) for k, v in by.items()}
        if n < passes:
            f = [ms / med[(j, w)] for j, w, ms in order]
            pace = [statistics.median(f[max(0, k - half):k + half + 1]) for k in range(len(f))]
    return med


def slope(groups) -> float:
    """Least-squares slope of ms on emitted tokens, pooled within groups of (emitted, ms) points."""
    num = den = 0.0
    for pts in groups:
        mx, my = statistics.mean(p[0] for p in pts), statistics.mean(p[1] for p in pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
    return num / den if den else 0.0


def table(seeds: int, reps: int, write: bool = False) -> str:
    """The replay's table of rivals and ablations (tests/replay_table.py) as markdown; with `write`, also its cache,
    its full table under tests/data/replay/ and the results page's summary (tests/replay_cache.py)."""
    from tests import replay_cache as C
    from tests import replay_table as T
    from tests.replay_rivals import ROWS

    cells = T.evaluate(T.modes_of(ROWS), seeds=seeds, reps=reps)
    rows = {m: label for m, (label, _) in ROWS.items()}
    if not write:
        return T.markdown(cells, rows)
    C.write(cells, rows)
    return f"wrote {C.CACHE.relative_to(C.ROOT)} and {C.FULL.relative_to(C.ROOT)}; docs/results.md's summary:\n\n" + T.summary(cells, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.policy_replay", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("lengths", help="decode the held-out prompts on the CPU and record L at every position")
    q.add_argument("--limit", type=int, default=4, help="prompts, in the bench's order (default 4)")
    q.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer (default 96, as the pair bench)")
    q.add_argument("--out", type=Path, default=Path("/tmp/replay/lengths.json"), help="where to write (default %(default)s)")
    q.add_argument("--force", action="store_true", help="replace --out if it exists (once the new one is complete)")
    q.add_argument("--target", type=Path, help="target folder (default: the SmolLM2 demo target)")
    q.add_argument("--draft", type=Path, help="drafter folder (default: the shipped SmolLM2 drafter)")
    q.add_argument("--prompts", type=Path, help="prompts file (default: the drafter's heldout.json)")
    r = sub.add_parser("costs", help="distil a `speed pair --trace` file into the replay's round costs")
    r.add_argument("trace", type=Path, help="a trace.jsonl(.gz) of `speed pair --trace`")
    r.add_argument("--bench", type=Path, required=True, help="that run's bench.json (the calibration table)")
    r.add_argument("--out", type=Path, required=True, help="where to write (.json.gz)")
    r.add_argument("--force", action="store_true", help="replace --out if it exists (once the new one is complete)")
    t = sub.add_parser("table", help="auto, its rivals and its ablation on every committed trace, as markdown")
    t.add_argument("--seeds", type=int, default=16, help="cost draws per scenario (default 16)")
    t.add_argument("--reps", type=int, default=10, help="interleaved repetitions per draw (default 10)")
    t.add_argument("--write", action="store_true", help="refresh the tracked cache and full table (tests/data/replay/"
                   "table.json, table.md; the default seeds and repetitions) and print the results page's summary")
    a = p.parse_args(argv)
    try:
        if a.cmd == "table":
            if a.seeds < 1 or a.reps < 1:
                raise ValueError("--seeds and --reps must be >= 1")
            if a.write and (a.seeds, a.reps) != (16, 10):
                raise ValueError("--write keeps the cache of the results page's table: 16 seeds, 10 repetitions")
            print(table(a.seeds, a.reps, a.write))
            return 0
        if a.cmd == "lengths":
            if (a.target is None) != (a.draft is None):
                raise ValueError("give --target and --draft together")
            lengths(a.out, a.limit, a.max_new_tokens, a.target, a.draft, a.prompts, a.force)
            return 0
        costs(a.trace, a.bench, a.out, force=a.force)
    except (OSError, EOFError, ValueError, KeyError, StopIteration) as e:
        print(f"error: {type(e).__name__ if isinstance(e, (KeyError, StopIteration)) else ''}{e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
