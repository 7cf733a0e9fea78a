"""The one place a backend keeps its drafting policies and the round costs they decide by: a `PolicyBook`.

- Cost tables, one per `CostKey` (device, model pair, options tag): read from the cost cache or timed by the
  backend's `CostSource` (costs/cache.py), or given as they are (`give`). An engine that batches times each job
  count at first use, and that count joins its key's table; any other engine times one table for every count.
- Live auto policies, one per (greedy, options tag): made at first use over the table of the current key.
- One driver of the policy protocol (`Drive`) that both backends run a request through: every job `start`s, each
  round asks its `width` and reports what it emitted (`observe`), and `end` finishes the jobs (and, on a batching
  engine, the request: `Policy.end_request`; `request` asks `Policy.plain` before one).
- What carries from one run to the next: `save` and `restore` (a warm-up leaves the policies as it found them; a
  chat turn starts from the start-up's acceptance with the round costs learnt since), and what the page shows of
  a live policy (`reading`).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..costs.book import Cost
from ..costs.cache import cached_costs
from ..costs.table import CostTable
from ..policy.chooser import Policy


@dataclass(frozen=True)
class CostKey:
    """What a cost table describes: the device, the model pair (its folders) and the engine options' tag."""

    device: str
    pair: tuple[str, ...]
    tag: str = ""


class CostSource(Protocol):
    """How a backend times its round costs for the book."""

    per_concurrency: bool       # whether each job count is timed on its own (a batching engine)

    def key(self) -> CostKey:
        """The key of the tables in use now (the options may change it)."""

    def file_key(self, concurrency: int) -> str | None:
        """The cost cache's name for the table of `concurrency` jobs (None: not cached)."""

    def measure(self, concurrency: int) -> CostTable:
        """Time the table of `concurrency` jobs now."""

    def check(self, concurrency: int) -> dict[int, dict[int, float]]:
        """A few widths timed now, that a cached table is checked against ({concurrency: {width: ms}})."""


class Drive:
    """One request through a policy, the protocol in its order (policy/chooser.py): `start` each job, then per round
    `width` and `observe`, then `end`. With `batching` the end also ends the request (`Policy.end_request`)."""

    def __init__(self, policy: Any, batching: bool = False):
        self.policy, self.batching = policy, batching
        self.jobs: list[Hashable] = []

    @classmethod
    def of(cls, policy: Any = None, width: int = 0) -> Drive:
        """A drive as given, or one of `policy` (None: a fixed width every round)."""
        return policy if isinstance(policy, Drive) else cls(policy or Policy.fixed(width))

    @property
    def draft_len(self) -> int:
        """Ids to draft when drafting (the policy's draft_len)."""
        return self.policy.draft_len

    def start(self, job: Hashable, last_token: int) -> None:
        self.policy.start(job, last_token)
        self.jobs.append(job)

    def width(self, jobs: int = 1) -> int:
        """The verify width of the next round of `jobs` jobs."""
        return self.policy.width(jobs)

    def observe(self, items: Sequence[tuple[Hashable, Sequence[int], Any]], ms: float | None = None) -> None:
        """One round: (job, its full proposal or (), its Round) for every job that emitted, and the round's ms."""
        self.policy.observe(items, ms)

    def choice(self, jobs: int) -> dict:
        """What the last width choice saw (for trace listeners): the acceptance rates and the cost curve."""
        costs = getattr(self.policy, "costs", None)
        return {"rates": [round(a, 3) for a in self.policy.rates],
                "curve": {} if costs is None else {w: round(t, 3) for w, t in costs.curve(jobs).items()}}

    def end(self) -> None:
        """Every started job finishes; on a batching engine the request ends too."""
        for job in self.jobs:
            self.policy.finish(job)
        if self.batching:
            self.policy.end_request(len(self.jobs))


@dataclass(frozen=True)
class Reading:
    """What a live auto policy knows at `jobs` jobs: acceptance per drafted position, the proposals it learnt that
    from, the round cost of every width (the curve), each cost it decides by (with its rounds, source and age) and
    the width it would pick now."""

    acceptance: list[float]
    proposals: int
    round_ms: list[float]
    costs: list[Cost]
    best_width: int


class PolicyBook:
    """A backend's cost tables and live auto policies (module docstring); `learn`: auto policies correct the tables
    by the rounds they time; `retime`: time again instead of reading the cost cache (`folder`, None: cost_dir())."""

    def __init__(self, block_size: int, source: CostSource, folder: str | Path | None = None, learn: bool = True):
        self.block_size, self.source, self.folder, self.learn = block_size, source, folder, learn
        self.retime = False
        self.tables: dict[CostKey, CostTable] = {}                 # one per key, a job count added per timing
        self.files: dict[CostKey, dict[int, CostTable]] = {}       # key -> {job count: the table the cache gave}
        self.given: set[CostKey] = set()                           # keys whose table is taken as it is
        self.policies: dict[tuple[bool, str], Policy] = {}         # (greedy, options tag) -> its live policy

    # -- the costs ---------------------------------------------------------------------------------------------

    def give(self, table: CostTable, learn: bool | None = None) -> None:
        """Decide by `table` as it is (never timed, nor extended) under the current key."""
        key = self.source.key()
        self.tables[key] = table
        self.given.add(key)
        if learn is not None:
            self.learn = learn

    def table(self, concurrency: int = 1) -> CostTable:
        """The table of the current key covering `concurrency` jobs: timing that count first if it is new (cached)."""
        key = self.source.key()
        table = self.tables.get(key)
        if key in self.given:
            return table
        c = concurrency if self.source.per_concurrency else 1
        if table is None or c not in table.ms:
            got = self.timed(c)
            ms = got.ms.get(c) or next(iter(got.ms.values()))
            files = self.files.setdefault(key, {})
            if table is None:                       # one table per key, one cache file per job count
                table = self.tables[key] = CostTable({c: ms}, got.device, got.source, timed_at=got.timed_at,
                                                     on_disagree=lambda n, why: tell(files.get(n), n, why))
            table.ms[c] = ms                        # the policies of this key read the same table
            table.counts[c] = got.counts.get(c) or next(iter(got.counts.values()), {})
            files[c] = got
        return table

    def timed(self, concurrency: int) -> CostTable:
        name = self.source.file_key(concurrency)
        measure = lambda: self.source.measure(concurrency)
        if name is None:
            return measure()
        return cached_costs(name, measure, self.folder, refresh=self.retime, check=lambda: self.source.check(concurrency))

    def source_text(self) -> str | None:
        """Where the current key's table came from ("timed now", "cached PATH", "given"), once there is one."""
        table = self.tables.get(self.source.key())
        return None if table is None else table.source

    # -- the policies ------------------------------------------------------------------------------------------

    def policy(self, greedy: bool, concurrency: int = 1) -> Policy:
        """The live auto policy of greedy or sampled decoding under the current options, its costs covering
        `concurrency` jobs (made at first use)."""
        table = self.table(concurrency)
        key = (greedy, self.source.key().tag)
        if key not in self.policies:
            self.policies[key] = Policy.auto(self.block_size, table, learn_costs=self.learn)
        return self.policies[key]

    def live(self, greedy: bool) -> Policy | None:
        """The live auto policy of greedy or sampled decoding under the current options (None before its first run)."""
        return self.policies.get((greedy, self.source.key().tag))

    def request(self, greedy: bool, jobs: int = 1, batching: bool = False) -> Drive | None:
        """The drive of one request of `jobs` jobs under the live policy; None when a batching engine should decode
        it without the drafter (Policy.plain)."""
        policy = self.policy(greedy, jobs)
        if batching and policy.plain(jobs):
            return None
        return Drive(policy, batching)

    def clear(self) -> None:
        """Forget every table and policy (another drafter: the costs and the acceptance start over)."""
        self.tables.clear()
        self.files.clear()
        self.given.clear()
        self.policies.clear()

    # -- what carries between runs, and what a page shows ------------------------------------------------------

    def save(self) -> dict:
        """A copy of the live policies that shares their cost tables (those describe the machine)."""
        return copy_policies(self.policies)

    def restore(self, saved: dict, carry_costs: bool = False) -> None:
        """Make the policies a fresh copy of `saved`. With `carry_costs` each keeps the round costs its live one
        learnt (they describe the machine, not a prompt; relearning them cost every turn about 5 rounds per width),
        and a policy made since the save starts afresh over its live costs."""
        fresh = copy_policies(saved)
        if carry_costs:
            for key, live in self.policies.items():
                costs = getattr(live, "costs", None)
                if isinstance(live, Policy) and costs is not None:
                    if key not in fresh:
                        fresh[key] = Policy.auto(live.block_size, costs.table, learn_costs=costs.learn)
                    fresh[key].costs = costs
        self.policies = fresh

    def reading(self, greedy: bool, jobs: int = 1) -> Reading | None:
        """What the live policy of greedy or sampled decoding knows now (None before its first run)."""
        pol = self.live(greedy)
        if pol is None or pol.costs is None:
            return None
        curve = CostTable({jobs: pol.costs.curve(jobs)}).curve(pol.block_size, jobs)
        return Reading(list(pol.rates), int(pol.count), curve, pol.costs.book(jobs), int(pol.best(jobs)))


def copy_policies(policies: dict) -> dict:
    """A deep copy of auto policies that shares their timed cost tables."""
    tables = [getattr(getattr(p, "costs", None), "table", None) for p in policies.values()]
    return copy.deepcopy(policies, {id(t): t for t in tables if t is not None})


def tell(got: CostTable | None, concurrency: int, why: str) -> None:
    """Pass the policy's word that live rounds disagree with the table of `concurrency` to that table's cache."""
    if got is not None and got.on_disagree is not None:
        got.on_disagree(concurrency, why)
