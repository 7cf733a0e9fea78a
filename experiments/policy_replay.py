"""Replay the exllamav3 drafting policy offline, on a CPU, against the pair bench's answers and measured round costs.

The pair bench on the device says `auto` trails the best fixed width by 2-4 %; this replay says why and tries a
change before device time is spent on it. Two steps:

- `lengths`: decodes the SmolLM2 pair's held-out prompts greedily on the CPU (torch backend, fp32) in the pair
  bench's order (`--limit`), and at every answer position records the drafter's full-width accepted length L:
  how many of its B-1 proposed tokens equal the target's next ones. Greedy output does not depend on the widths
  verified, so one decode gives every position; writes lengths.json.
- `run`: replays the bench's `auto`, B=8 and B=16 cells (c = 1, 4, 8, the jobs of one request decoded together
  with one width per round, as exllamav3 does) over those lengths, with round costs read from a `speed pair
  --trace` file: each (jobs, width) costs a round drawn from that trace's rounds of that shape (rounds of a
  width never traced at that job count: its nearest traced width's, shifted by the w=7 to w=15 slope), plus the
  trace's measured cost per extra emitted token and SWITCH_MS for a round at another width than the last. The
  policy is the backend's own `BatchPolicy`, with the bench's calibration table as its prior; it sees the rounds'
  times as it would on the device. Prints tokens per ms per cell and `auto` over the best fixed width, paired
  per repetition.

    python -m experiments.policy_replay lengths --limit 4 --out /tmp/replay/lengths.json
    python -m experiments.policy_replay run /tmp/replay/lengths.json \\
        --trace docs/speed_2026-12-06-s21/pair_call4_trace.jsonl.gz --bench docs/speed_2026-12-06-s21/pair_call4_bench.json

The CPU drafter is the BF16 drafter in fp32, not the device's EXL3 6 bpw one, so the lengths are close to the
device's, not equal; new shapes' CUDA graph captures are not modelled (every shape is warm). The replay compares
policies on the same lengths and costs; its c=1 levels match the device (call 4: AR 77.5 vs 77.8 tok/s, auto / B=8
0.980 vs 0.974), its c = 4 and 8 ones less well (per-job-count costs are thinner there).
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


def full_lengths(steps, prompt_ids: list[int], answer: list[int], positions: int) -> list[int]:
    """L at every answer position p: the drafter's proposal after answer[p], matched against answer[p+1:]."""
    from toolkit.runtime.loop import accepted_prefix

    steps.prefill(prompt_ids)
    out = []
    for p in range(len(answer) - 1):
        truth = answer[p + 1:p + 1 + positions]
        out.append(accepted_prefix(steps.draft_block(answer[p], positions)[:len(truth)], truth))
        steps.verify([answer[p]])
        steps.accept(1)
    return out


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
        L = full_lengths(TorchSteps(be.target, be.drafter), ids, answer, be.block_size - 1)
        rows.append({"category": item.category, "answer": answer, "lengths": L})
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

class TraceCosts:
    """Round ms per (jobs, width) drawn from a `speed pair --trace` file's decoding rounds, plus a cost per
    emitted token beyond one per job."""

    def __init__(self, trace: Path, seed: int = 0):
        rows = read_trace(trace)
        self.by: dict[tuple[int, int], list[float]] = defaultdict(list)
        groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        self.prefill: dict[int, list[float]] = defaultdict(list)
        for r in rows:
            if "/n96" not in r["cell"] or r["ms"] >= 100 and r["jobs"]:
                continue
            if r["jobs"] and r["emitted"] >= r["jobs"]:
                self.by[(r["jobs"], r["w"])].append(r["ms"])
                if not r["cell"].startswith(("auto", "ar")):     # fixed widths: ms against emitted tokens
                    groups[(r["cell"], r["jobs"])].append((r["emitted"], r["ms"]))
            elif not r["jobs"] and r["cell"].startswith("8/"):
                self.prefill[int(r["cell"].split("/")[1][1:])].append(r["ms"])
        self.per_token = slope(groups.values())
        self.rng = random.Random(seed)
        self._shapes: dict[tuple[int, int], list[float]] = {}

    def shape(self, jobs: int, w: int) -> list[float]:
        """The traced rounds of (jobs, w), or of the nearest traced shape (job count first) shifted to it: by the
        AR step's difference between the job counts, and by the B=8 to B=16 slope per width at `jobs`."""
        if (jobs, w) not in self._shapes:
            if self.traced(jobs, w):
                self._shapes[(jobs, w)] = self.by[(jobs, w)]
            else:
                near = min((k for k in self.by if self.traced(*k)), key=lambda k: (abs(k[0] - jobs), abs(k[1] - w)))
                wide = self.traced(jobs, 15) and self.traced(jobs, 7)
                slope_w = (self.median(jobs, 15) - self.median(jobs, 7)) / 8 if wide else 0.0
                ar = self.traced(jobs, 0) and self.traced(near[0], 0)
                shift_j = self.median(jobs, 0) - self.median(near[0], 0) if ar else 0.0
                self._shapes[(jobs, w)] = [x + slope_w * (w - near[1]) + shift_j for x in self.by[near]]
        return self._shapes[(jobs, w)]

    def traced(self, jobs: int, w: int) -> bool:
        return len(self.by.get((jobs, w), ())) >= MIN_ROUNDS

    def prefill_ms(self, c: int) -> float:
        """The traced B=8 cell's prefill iterate at the nearest concurrency (0 where none was traced)."""
        if not self.prefill:
            return 0.0
        return statistics.median(self.prefill[min(self.prefill, key=lambda k: (abs(k - c), k))])

    def median(self, jobs: int, w: int) -> float:
        return statistics.median(self.by[(jobs, w)])

    def round_ms(self, jobs: int, w: int, extra_tokens: int) -> float:
        return self.rng.choice(self.shape(jobs, w)) + self.per_token * extra_tokens


def slope(groups) -> float:
    """Least-squares slope of ms on emitted tokens, pooled within groups of (emitted, ms) points."""
    num = den = 0.0
    for pts in groups:
        mx, my = statistics.mean(p[0] for p in pts), statistics.mean(p[1] for p in pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
    return num / den if den else 0.0


# -- the replay -------------------------------------------------------------------------------------------------

class Job:
    """One answer being decoded: its tokens, full-width lengths and how many it has emitted."""

    def __init__(self, row: dict, max_new: int):
        self.answer, self.lengths = row["answer"], row["lengths"]
        self.cap = min(max_new, len(self.answer))
        self.n = 1                                   # the prefill round emitted answer[0]

    def round(self, w: int, positions: int):
        """(full proposal or (), Round) of one round verifying w drafts."""
        from toolkit.runtime.events import Round

        start = self.n
        L = self.lengths[start - 1] if start - 1 < len(self.lengths) else 0
        e = min(min(L, w) + 1, self.cap - start)
        toks = self.answer[start:start + e]
        self.n += e
        if not w:
            return (), Round((), 0, toks[-1])
        proposal = tuple(self.answer[start:start + L]) + (-1,) * (positions - L)
        drafted = proposal[:w]
        return proposal, Round(drafted, e - 1, toks[-1], proposed=positions)


def replay_request(rows: list[dict], max_new: int, w_fixed: int | None, policy, costs: TraceCosts,
                   positions: int, host_ms: float, prefill_ms: float, switch_ms: float = 0.0) -> tuple[int, float]:
    """(tokens, ms) of one request whose jobs decode together, one width per round; a round whose width differs
    from the one before costs `switch_ms` more."""
    jobs = [Job(r, max_new) for r in rows]
    last = None
    tokens, ms = len(jobs), prefill_ms * len(jobs)
    if policy is not None:
        policy.begin_request()
        for i, r in enumerate(rows):
            policy.begin_job(i, -2)
            policy.observe_round([(i, (), _prefill(r["answer"][0]))])
    while True:
        live = [(i, j) for i, j in enumerate(jobs) if j.n < j.cap]
        if not live:
            break
        if policy is not None:
            policy.use_concurrency(len(live), min(j.cap - j.n for _, j in live))
            w = policy.width()
        else:
            w = w_fixed
        out = [(i, *j.round(w, positions)) for i, j in live]
        emitted = sum(len(r.tokens) for _, _, r in out)
        t = costs.round_ms(len(live), w, emitted - len(live)) + (switch_ms if last is not None and w != last else 0.0)
        last = w
        tokens, ms = tokens + emitted, ms + t + host_ms
        if policy is not None:
            policy.observe_round(out, t)
    if policy is not None:                           # the backend ends its jobs with the request
        for i in range(len(rows)):
            policy.end_job(i)
        policy.end_request(len(rows))
    return tokens, ms


def _prefill(token: int):
    from toolkit.runtime.events import Round

    return Round((), 0, token, prefill=True)


def job_rows(rows: list[dict], conc: int) -> list[list[dict]]:
    """The bench's requests of one cell: benchgrid's job list, in waves of `conc` (benchgrid.run_cell)."""
    from toolkit.benchmark.grid import job_list

    jobs = job_list(rows, conc)
    return [jobs[k:k + conc] for k in range(0, len(jobs), conc)]


def make_policy(bench: Path, block_size: int, **kw):
    """The backend's BatchPolicy over the calibration table the bench's `auto` cells started from."""
    from toolkit.policy.batch import BatchPolicy
    from toolkit.policy.policy import CostTable

    cell = next(c for c in json.loads(bench.read_text())["cells"] if c["block_size"] == "auto" and "costs" in c)
    table = CostTable(cell["costs"]["start"])              # CostTable turns the JSON's string keys into ints
    return BatchPolicy(block_size, table, concurrency=1, learn_costs=True, shapes=None, **kw)


def replay(data: dict, trace: Path, bench: Path, concurrency: list[int], reps: int, seed: int,
           host_ms: float, auto_host_ms: float, policy_kw: dict | None = None, switch_ms: float = SWITCH_MS) -> dict:
    """tok/ms per rep of AR, auto, B=16 and B=8 at each concurrency, interleaved as the bench runs them (one
    policy for every `auto` cell, as the backend keeps one); `policy_kw`: BatchPolicy arguments to try."""
    B, max_new, rows = data["block_size"], data["max_new_tokens"], data["prompts"]
    costs = TraceCosts(trace, seed)
    policy = make_policy(bench, B, **(policy_kw or {}))
    cells = [(c, m) for c in concurrency for m in ("ar", "auto", 16, 8)]
    got: dict[tuple, list[float]] = defaultdict(list)
    for _ in range(reps):
        for c, mode in cells:
            tokens = ms = 0.0
            waves = job_rows(rows, c)
            warm = [dict(r, answer=r["answer"][:8]) for r in waves[0]]                   # the bench's warm-up wave
            for k, req in enumerate([warm] + waves):
                pol = policy if mode == "auto" else None
                w = None if mode == "auto" else (0 if mode == "ar" else mode - 1)
                tk, t = replay_request(req, max_new, w, pol, costs, B - 1,
                                       auto_host_ms + host_ms if pol is not None else host_ms,
                                       costs.prefill_ms(c) / c, switch_ms)
                if k:                                 # the warm-up wave is not timed
                    tokens, ms = tokens + tk, ms + t
            got[(c, mode)].append(tokens / ms)
    out = {}
    for c in concurrency:
        row = {str(m): statistics.median(got[(c, m)]) for m in ("ar", "auto", 16, 8)}
        best = max((16, 8), key=lambda m: statistics.median(got[(c, m)]))
        ratios = [a / b for a, b in zip(got[(c, "auto")], got[(c, best)])]
        row.update(best=best, auto_over_best=statistics.median(ratios), auto_over_ar=row["auto"] / row["ar"])
        out[str(c)] = row
    return out


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
    r = sub.add_parser("run", help="replay the pair bench's cells over recorded lengths and traced costs")
    r.add_argument("lengths", type=Path, help="a lengths.json written by the `lengths` step")
    r.add_argument("--trace", type=Path, required=True, help="a trace.jsonl(.gz) of `speed pair --trace`")
    r.add_argument("--bench", type=Path, required=True, help="that run's bench.json (the calibration table)")
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="default 1 4 8")
    r.add_argument("--reps", type=int, default=10, help="repetitions per replay (default 10)")
    r.add_argument("--seeds", type=int, default=5, help="replays with different cost draws (default 5)")
    r.add_argument("--host-ms", type=float, default=0.05, help="host ms between rounds of every cell (default 0.05)")
    r.add_argument("--auto-host-ms", type=float, default=0.094, help="what auto adds per round (default 0.094: call 13)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "lengths":
            if (a.target is None) != (a.draft is None):
                raise ValueError("give --target and --draft together")
            lengths(a.out, a.limit, a.max_new_tokens, a.target, a.draft, a.prompts, a.force)
            return 0
        if a.reps < 1 or a.seeds < 1 or min(a.concurrency) < 1:
            raise ValueError("--reps, --seeds and --concurrency must be >= 1")
        data = json.loads(a.lengths.read_text())
        rows = [replay(data, a.trace, a.bench, a.concurrency, a.reps, s, a.host_ms, a.auto_host_ms)
                for s in range(a.seeds)]
    except (OSError, EOFError, ValueError, KeyError, StopIteration) as e:
        print(f"error: {type(e).__name__ if isinstance(e, (KeyError, StopIteration)) else ''}{e}", file=sys.stderr)
        return 2
    print("| c | AR tok/ms | auto | B=16 | B=8 | auto / best fixed (paired, mean over seeds) | auto / AR |")
    print("|---|---|---|---|---|---|---|")
    for c in map(str, a.concurrency):
        m = {k: statistics.mean(r[c][k] for r in rows) for k in ("ar", "auto", "16", "8", "auto_over_best", "auto_over_ar")}
        print(f"| {c} | {m['ar']:.4f} | {m['auto']:.4f} | {m['16']:.4f} | {m['8']:.4f} | "
              f"{m['auto_over_best']:.4f} (seeds {min(r[c]['auto_over_best'] for r in rows):.4f}-"
              f"{max(r[c]['auto_over_best'] for r in rows):.4f}) | {m['auto_over_ar']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
