"""The drafting policy: per round, the verify width w that maximises expected tokens per second.

A round that verifies w drafts emits 1 + sum_{i<=w} a_i tokens on average (a_i: probability that draft position
i is accepted) and costs t_round(w); w = 0 is a plain AR round with no drafter call. `Policy.auto` picks the best
w every round from a measured `CostTable` and running estimates of a_i; `Policy.fixed` verifies one width every
round (the classic decoder at B-1, AR at 0).

Acceptance is learnt in hindsight. The DFlash drafter proposes all B-1 positions in one forward whatever w is
verified, so each proposal is kept and compared with the tokens the target emits over the next rounds: that gives
its full-width accepted length L, and a_i = P(L >= i) for every position, verified or not. AR rounds propose
nothing, so while the policy decodes AR it probes with one full-width round every N AR rounds; N doubles while
probes leave the estimates on AR, up to a cap that keeps probing within ~3 % of AR, and starts small again once
speculation wins (a probe that alone beats AR brings the next one forward, so a comeback is seen quickly). A
probe's cost is counted net of the tokens it is expected to emit, and no probe comes before `min_probe_every` AR
rounds of the current sequence (with `first_probe_cost`, the rounds a probe needs to cost at most that share of
them), so a short answer never pays a whole probe. Costs are timed once per model pair and device
and cached as JSON (`cached_costs`); with `learn_costs` the policy also rescales the drafting rounds' costs by what
it observes (drafting rounds against AR rounds), so a stale or noisy table cannot keep it drafting at a loss.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..runtime.events import Round
from ..runtime.sampling import Sampler

COST_CACHE_ENV = "DFLASH_COST_CACHE"   # a folder that replaces ~/.cache/dflash-toolkit/costs


# -- costs -----------------------------------------------------------------------------------------------------

@dataclass
class CostTable:
    """Measured ms per round: {concurrency: {verify width w: ms}}, w = 0 the AR step.

    Widths that were not measured are interpolated linearly between measured ones >= 1 (flat below the smallest,
    the last slope above the largest). The curve is non-decreasing: measured drafting widths that cost more than a
    wider one are pooled with it into their mean (`monotone`), since one slow width must not raise every wider one
    (2026-12-05, H100: w=3 read 25 ms, w=7-15 18-19, and the old running maximum charged 25 ms to all of them;
    exllamav3's rounds at w=3 do cost ~1 ms more than at w=7 on the SmolLM2 pair), and no drafting width costs
    less than the AR step.
    """

    ms: dict[int, dict[int, float]]
    device: str = ""

    def __post_init__(self) -> None:
        self.ms = {int(c): {int(w): float(t) for w, t in pts.items()} for c, pts in self.ms.items()}
        if not self.ms:
            raise ValueError("cost table is empty")
        for c, pts in self.ms.items():
            if c < 1 or 0 not in pts or not any(w > 0 for w in pts):
                raise ValueError(f"concurrency {c}: need the AR cost (w=0) and at least one width > 0")
            if any(w < 0 or not (math.isfinite(t) and t > 0) for w, t in pts.items()):
                raise ValueError(f"concurrency {c}: widths must be >= 0 and costs finite and > 0")

    def curve(self, block_size: int, concurrency: int = 1) -> list[float]:
        """t_round(w) in ms for w = 0..block_size-1 at the nearest measured concurrency."""
        pts = self.nearest(concurrency)
        spec = monotone([(w, t, 1) for w, t in sorted(pts.items()) if w > 0])
        out = [pts[0]]
        for w in range(1, block_size):
            out.append(max(out[-1], interpolate(spec, w)))
        return out

    def nearest(self, concurrency: int = 1) -> dict[int, float]:
        """{w: ms} of the measured concurrency nearest `concurrency` (ties: the lower one)."""
        return self.ms[min(self.ms, key=lambda c: (abs(c - concurrency), c))]

    def widths(self, concurrency: int = 1) -> list[int]:
        """The widths measured at the nearest measured concurrency (those `curve` does not interpolate)."""
        return sorted(self.nearest(concurrency))

    def to_json(self) -> dict:
        return {"device": self.device, "ms": {str(c): {str(w): t for w, t in sorted(p.items())} for c, p in sorted(self.ms.items())}}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls(ms=d["ms"], device=str(d.get("device", "")))


def interpolate(points: list[tuple[int, float]], w: int) -> float:
    """Piecewise-linear value at w through sorted (width, ms) points: flat below, last slope (>= 0) above."""
    if w <= points[0][0] or len(points) == 1:
        return points[0][1] if w <= points[0][0] else points[-1][1]
    for (w0, t0), (w1, t1) in zip(points, points[1:]):
        if w <= w1:
            return t0 + (t1 - t0) * (w - w0) / (w1 - w0)
    (w0, t0), (w1, t1) = points[-2], points[-1]
    return t1 + max(t1 - t0, 0.0) * (w - w1) / (w1 - w0)


def monotone(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """(width, ms) through sorted (width, ms, weight) points, made non-decreasing by pooling adjacent violators into
    their weighted mean (isotonic regression): noise in one width's cost does not raise every wider one."""
    blocks: list[list] = []                              # [total weight, weighted sum, widths]
    for w, t, n in points:
        blocks.append([n, n * t, [w]])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] > blocks[-1][1] / blocks[-1][0]:
            n2, s2, w2 = blocks.pop()
            blocks[-1][0] += n2
            blocks[-1][1] += s2
            blocks[-1][2] += w2
    return [(w, s / n) for n, s, ws in blocks for w in ws]


def measure_widths(block_size: int) -> list[int]:
    """Widths to time: all of 0..B-1 up to B = 17, else 0, powers of two and B-1."""
    if block_size <= 17:
        return list(range(block_size))
    return sorted({0, block_size - 1} | {1 << k for k in range(block_size.bit_length()) if 1 << k < block_size})


def measure_steps(steps, prompt_ids: list[int], block_size: int, widths: Iterable[int] | None = None,
                  reps: int = 5, sync: Callable[[], None] = lambda: None,
                  stat: Callable[[list[float]], float] = statistics.median) -> dict[int, float]:
    """ms of one round per verify width on a `Steps` backend (`stat` over reps, the median by default): draft B-1
    (w > 0), verify w+1, accept 1.

    Rounds are interleaved over widths (drift spreads evenly) after one warm-up pass; each keeps one token, so
    the context grows by one token per round. `sync` waits for the device (CUDA) before reading the clock. On a
    machine shared with other work, `stat=min` drops the rounds that other processes slowed down.
    """
    widths = sorted(set(measure_widths(block_size) if widths is None else widths) | {0})
    sampler = Sampler()
    token = sampler(steps.prefill(prompt_ids))[-1]
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):
        for w in widths:
            sync()
            t0 = time.perf_counter()
            drafts = steps.draft_block(token, block_size - 1)[:w] if w else []
            picks = sampler(steps.verify([token] + drafts))
            steps.accept(1)
            sync()
            if rep:
                times[w].append((time.perf_counter() - t0) * 1000.0)
            token = picks[0]
    return {w: stat(ts) for w, ts in times.items()}


def measure_torch_costs(target, drafter, block_size: int | None = None, context: int = 32, reps: int = 5,
                        widths: Iterable[int] | None = None,
                        stat: Callable[[list[float]], float] = statistics.median) -> CostTable:
    """Time rounds of a transformers target + reference drafter (the torch backend, one sequence: c = 1)."""
    from ..runtime.torch_backend import TorchSteps        # lazy: torch_backend may import this module

    B = block_size or drafter.config.block_size
    vocab = int(target.get_input_embeddings().weight.shape[0])
    prompt = [(7 * i + 3) % vocab for i in range(context)]
    dev = target.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    ms = measure_steps(TorchSteps(target, drafter), prompt, B, widths, reps, sync, stat)
    return CostTable({1: ms}, device_name(dev))


def device_name(device: torch.device | str) -> str:
    """The accelerator's name, or the CPU's with its thread count (both change round costs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()}"


def cost_key(folders: Iterable[str | Path], device: torch.device | str, dtype, block_size: int) -> str:
    """Cache key: the model folders' config.json hash, the device name, the dtype and the block size."""
    h = hashlib.sha256()
    for f in folders:
        p = Path(f) / "config.json"
        h.update(p.read_bytes() if p.is_file() else str(f).encode())
    h.update(f"|{device_name(device)}|{dtype}|{block_size}".encode())
    return h.hexdigest()[:20]


def cost_dir() -> Path:
    """Where measured cost tables live: $DFLASH_COST_CACHE, else $XDG_CACHE_HOME or ~/.cache /dflash-toolkit/costs."""
    if os.environ.get(COST_CACHE_ENV):
        return Path(os.environ[COST_CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-toolkit" / "costs"


def cached_costs(key: str, measure: Callable[[], CostTable], folder: str | Path | None = None,
                 refresh: bool = False) -> CostTable:
    """The cost table stored under `key`, or a fresh `measure()` saved there; a broken file is re-measured."""
    path = Path(folder or cost_dir()) / f"{key}.json"
    if path.is_file() and not refresh:
        try:
            return CostTable.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass                                 # corrupt or foreign: measure again and overwrite
    table = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(table.to_json(), f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass                                     # a read-only cache only costs a re-measure next time
    return table


# -- acceptance ------------------------------------------------------------------------------------------------

class Hindsight:
    """Full-width accepted lengths of one sequence's proposals, resolved as the target emits its tokens."""

    def __init__(self, first_token: int):
        self.stream = [first_token]              # every emitted token; the last one is the next block's start
        self.pending: list[list] = []            # [index of the first predicted token, proposal, matched so far]

    def add(self, proposal: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Record a round (its full proposal, its emitted tokens); return the lengths L resolved by it."""
        if proposal:
            self.pending.append([len(self.stream), tuple(proposal), 0])
        self.stream.extend(tokens)
        done, keep = [], []
        for p in self.pending:
            start, ids, j = p
            while j < len(ids) and start + j < len(self.stream) and ids[j] == self.stream[start + j]:
                j += 1
            if j == len(ids) or start + j < len(self.stream):     # all confirmed, or a mismatch seen
                done.append(j)
            else:
                p[2] = j
                keep.append(p)
        self.pending = keep
        return done


class Acceptance:
    """a_i = P(L >= i), i = 1..positions: exponentially weighted running means from a geometric prior."""

    def __init__(self, positions: int, prior: float = 0.6, weight: float = 2.0, decay: float = 0.95):
        self.decay, self.weight = decay, weight
        self.sums = [weight * prior ** i for i in range(1, positions + 1)]
        self.count = 0

    def update(self, length: int) -> None:
        self.weight = self.decay * self.weight + 1.0
        self.sums = [self.decay * s + (i < length) for i, s in enumerate(self.sums)]
        self.count += 1

    def forget(self, weight: float) -> None:
        """Keep the estimates but let them weigh at most `weight` observations (a new sequence may differ)."""
        if self.weight > weight:
            k = weight / self.weight
            self.sums, self.weight = [s * k for s in self.sums], weight

    @property
    def rates(self) -> list[float]:
        return [s / self.weight for s in self.sums]

    def expected_tokens(self) -> list[float]:
        """1 + sum_{i<=w} a_i for w = 0..positions: the mean tokens of a round that verifies w drafts."""
        out = [1.0]
        for a in self.rates:
            out.append(out[-1] + a)
        return out


# -- the policy ------------------------------------------------------------------------------------------------

class Policy:
    """Chooses each round's verify width and learns from the rounds it sees. One per backend and drafter pair.

    The loop calls `begin(first token)` after prefill, `width()` before each round, drafts `draft_len` ids when
    the width is > 0, verifies the first `width` of them and hands the round back through `observe`.
    """

    def __init__(self, block_size: int, costs: CostTable | None = None, fixed_width: int | None = None,
                 concurrency: int = 1, prior: float = 0.6, decay: float = 0.95, probe_budget: float = 0.03,
                 min_probe_every: int = 4, first_probe_cost: float | None = None, learn_costs: bool = False,
                 carry_weight: float | None = None):
        if fixed_width is None and (costs is None or block_size < 2):
            raise ValueError("an auto policy needs a cost table and a block size >= 2")
        if not 0 <= (fixed_width or 0) < max(block_size, 1):
            raise ValueError(f"width {fixed_width} outside 0..{block_size - 1}")
        self.block_size, self.costs, self.fixed_width = block_size, costs, fixed_width
        self.acceptance = Acceptance(block_size - 1, prior, decay=decay)
        self.hindsight: Hindsight | None = None
        self.floor = self.min_probe_every = self.probe_every = self.gap = min_probe_every   # gap: AR rounds before the next probe
        self.probe_budget, self.first_probe_cost, self.ar_rounds, self.probing = probe_budget, first_probe_cost, 0, False
        self.seq_ar = 1 << 30                    # AR rounds of this sequence since its start or its last draft
        self.learn_costs, self.seen = learn_costs, [None, None]   # observed/table ms of AR and of drafting rounds
        self.carry_weight = carry_weight                          # what earlier sequences weigh at a new one's start
        self.drift = 1.0                                          # the drafting rounds' cost factor in use
        self._best: tuple | None = None                           # (acceptance count, version, best width)
        self.version = 0
        self.menu: list[int] | None = None                        # the widths best() may pick (None: all)
        self.set_concurrency(concurrency)

    @classmethod
    def fixed(cls, width: int) -> "Policy":
        """Verify `width` drafts every round (B-1 = the classic decoder, 0 = AR); drafts only those."""
        return cls(width + 1, fixed_width=width)

    @classmethod
    def auto(cls, block_size: int, costs: CostTable, **kw) -> "Policy":
        """Pick the width with the most expected tokens per ms every round; drafts all B-1 positions."""
        return cls(block_size, costs, **kw)

    def set_concurrency(self, concurrency: int) -> None:
        """Use the cost curve of `concurrency` sequences per round (batching engines)."""
        self.table = [1.0] * self.block_size if self.costs is None else self.costs.curve(self.block_size, concurrency)
        self.rescale(self.drift)

    def rescale(self, drift: float) -> None:
        """Charge drafting rounds `drift` times their tabled cost (1 = the table) and re-derive the probe spacing."""
        self.drift, self.version = drift, self.version + 1
        self.t = [self.table[0]] + [x * drift for x in self.table[1:]]
        self.space_probes()

    def probe_extra(self) -> float:
        """What a full-width probe costs beyond the AR rounds it replaces, in AR rounds: its round time less an AR
        step per token it is expected to emit (at the current acceptance estimates), at least 1 % of a step."""
        return max((self.t[-1] - self.t[0] * self.acceptance.expected_tokens()[-1]) / self.t[0], 0.01)

    def space_probes(self) -> None:
        """Probe cap (steady state: probes cost `probe_budget` of AR time) and, with `first_probe_cost`, the first
        gap after speculation: the first probe waits until it costs at most that share of the AR rounds before it."""
        if self.costs is None:
            return
        extra = self.probe_extra()
        if self.first_probe_cost is not None:
            self.min_probe_every = max(self.floor, min(math.ceil(extra / self.first_probe_cost), 1 << 16))
        self.probe_cap = max(self.min_probe_every, min(math.ceil(extra / self.probe_budget), 1 << 16))
        self.probe_every = min(max(self.probe_every, self.min_probe_every), self.probe_cap)
        self.gap = min(max(self.gap, self.min_probe_every), self.probe_cap)

    @property
    def draft_len(self) -> int:
        """Ids to draft when drafting: all B-1 in auto mode (hindsight needs them), the width in fixed mode."""
        return self.block_size - 1 if self.fixed_width is None else self.fixed_width

    def scores(self) -> list[float]:
        """Expected tokens per ms for each width w = 0..B-1."""
        return [n / t for n, t in zip(self.acceptance.expected_tokens(), self.t)]

    def best(self) -> int:
        """The width with the most expected tokens per ms; recomputed only when acceptance or costs changed."""
        key = (self.acceptance.count, self.version)
        if self._best is None or self._best[:2] != key:
            s = self.scores()
            menu = self.menu or range(len(s))
            self._best = (*key, max(menu, key=lambda w: (s[w], -w)))     # ties go to the narrower width
        return self._best[2]

    def begin(self, first_token: int) -> None:
        """A new sequence starts after `first_token`; its pending proposals are dropped (censored), and with
        `carry_weight` what earlier sequences taught weighs that many rounds, so a new prompt's acceptance shows fast."""
        self.hindsight, self.probing, self.seq_ar = Hindsight(first_token), False, 0
        if self.carry_weight is not None:
            self.acceptance.forget(self.carry_weight)

    def width(self) -> int:
        """The verify width of the next round."""
        if self.fixed_width is not None:
            return self.fixed_width
        w, self.probing = self.best(), False
        if w > 0:                                               # speculation wins: probe soon once AR takes over
            self.probe_every = self.gap = self.min_probe_every
            return w
        if self.ar_rounds >= self.gap and self.seq_ar >= self.min_probe_every:     # never early in an answer
            self.probing = True
            return self.block_size - 1
        return 0

    def observe(self, proposal: Sequence[int], rnd: Round) -> None:
        """Learn from a finished round: its full proposal (empty for AR) and what it emitted."""
        if self.hindsight is None:
            self.begin(rnd.bonus)
            return
        for length in self.hindsight.add(proposal, rnd.tokens):
            self.acceptance.update(length)
        if self.fixed_width is not None:
            return
        if self.learn_costs:
            self.learn(len(rnd.drafted), rnd.t_draft_ms + rnd.t_verify_ms)
        self.ar_rounds = 0 if rnd.drafted else self.ar_rounds + 1
        self.seq_ar = 0 if rnd.drafted else self.seq_ar + 1
        if self.probing and self.best() == 0:
            self.back_off(rnd.accepted)
        self.probing = False

    def learn(self, width: int, ms: float) -> None:
        """Fold a round's observed time into the drafting rounds' cost factor: (observed / tabled ms of drafting
        rounds) over (the same of AR rounds), running means with outliers clipped, within 1/8..8 of the table."""
        if ms <= 0:
            return
        k, r = int(width > 0), ms / self.table[width]
        old = self.seen[k]
        self.seen[k] = r if old is None else old + (0.3 if k else 0.1) * (min(max(r, old / 3), 3 * old) - old)
        if None not in self.seen:
            drift = min(max(self.seen[1] / self.seen[0], 1 / 8), 8.0)
            if abs(drift / self.drift - 1) > 0.1:
                self.rescale(drift)

    def back_off(self, accepted: int) -> None:
        """After a probe that left the estimate on AR: probe again soon if this one alone beat AR (acceptance may
        have come back; a few more probes confirm it), else wait twice as long, up to the cap (re-derived from the
        acceptance the probes have taught)."""
        self.space_probes()
        if any((1 + w) / self.t[w] > 1 / self.t[0] for w in range(1, accepted + 1)):
            self.gap = self.min_probe_every
        else:
            self.probe_every = self.gap = min(2 * self.probe_every, self.probe_cap)
