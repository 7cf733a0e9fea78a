"""The exllamav3 backend: an EXL3 (or unquantized) target and an EXL3 (or BF16) DFlash drafter on exllamav3 1.6.5,
or the target's own MTP head (`--draft mtp`: exllamav3's MTP component of a Qwen3.5/3.6 checkpoint, drafting up to
mtp.DEPTH ids a round, one head step each; its rounds are captured and verified the same way).

`Exl3Backend` is the Backend face (generate, generate_many, prepare, the levers, the reports); the engine under it
(engine.py: loading, the Generator, jobs, the walk of a request's rounds) runs exllamav3's own Generator (paged
cache, batched jobs, DFlash verification), and the drafted ids of each round come from the capture in hook.py. The
AR baseline is a Generator over the same target and cache with no drafter. exllamav3 is imported only when a backend
is built, so this module imports on any machine.

The drafting policy (block_size "auto", the default; toolkit/policy), kept with its costs in the backend's
PolicyBook (runtime/policy_book.py), maps onto exllamav3's knobs as follows:
- before each iterate() the recording Generator's `num_draft_tokens` is set to the width the policy picks for the
  current number of jobs (one width for all: exllamav3 verifies a rectangle; 0 is a plain decode step). The
  drafter's block is computed whole, so the hook keeps all B-1 proposals for hindsight acceptance. One speculative
  Generator (built for B-1) serves every width; one without drafter is the AR baseline.
- a request runs on the AR baseline's Generator when the policy says drafting stopped paying (Policy.plain).
- t_round(w, c) is timed on the loaded model at first use of each concurrency c (calibrate.py, `Exl3Costs`) and
  cached per model pair, GPU and options: the policy's prior, corrected by the iterate() times it observes, over
  the timed widths.
- the levers (options.py) change what a round costs, never the width or the output.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..core.errors import ToolkitError
from ..runtime.backend import Backend, GenSettings
from ..runtime.events import Round
from ..runtime.pair import ModelPair
from ..runtime.registry import capabilities
from ..runtime.policy_book import CostKey, Drive, PolicyBook
from . import seams
from .memory import GIB, cache_bytes, check_memory, weight_bytes  # noqa: F401  (re-exported)
from .draft_levers import set_draft_levers
from .engine import Exl3Engine
from .options import ADOPTED, Exl3Options
from .calibrate import TABLE_VERSION, calibrate, spot_check
from ..runtime.placement import GpuSplit
from ..costs.cache import cost_key, device_name
from ..costs.table import CostTable
from ..policy.chooser import Policy


class Exl3Backend(Backend):
    """Backend over exllamav3 models (an `Exl3Engine`); `generate_many` runs several jobs in one generator."""

    name = "exllamav3"
    caps = capabilities("exllamav3")

    @classmethod
    def installed(cls) -> bool:
        return seams.version() is not None
    clock = staticmethod(time.perf_counter)
    draft_classes: tuple[type, type] | None = None    # the drafter levers' module classes (None: exllamav3's)

    def __init__(self, engine: Exl3Engine, hf_tokenizer, max_context: int = 0, eos_ids: tuple[int, ...] = (), *,
                 options: Exl3Options | None = None, folders: Sequence[str | Path] = (), vocab_size: int = 32000,
                 device: str = "cuda", moe_class: type | None = None, cost_cache: str | Path | None = None,
                 split: GpuSplit | None = None):
        self.engine, self.tokenizer = engine, hf_tokenizer
        self.block_size, self.max_context, self.eos_ids = engine.block_size, max_context, eos_ids
        self.folders, self.vocab_size, self.device = tuple(folders), vocab_size, device
        self._moe_class = moe_class
        self.split = split or GpuSplit()
        self.options = Exl3Options()
        self._graphs: dict = {}           # each model's whole-forward graphs (forward_graphs), kept across toggles
        self.timing = Exl3Costs(self)
        self.book = PolicyBook(self.block_size, self.timing, cost_cache)
        self.set_options(options or ADOPTED)

    # what the levers, the swap and the quantize steps reach through the face: the engine's models and sizes
    model = property(lambda self: self.engine.model)
    draft = property(lambda self: self.engine.draft)
    cache = property(lambda self: self.engine.cache)
    draft_cache = property(lambda self: self.engine.draft_cache)
    exl = property(lambda self: self.engine.exl)
    cache_tokens = property(lambda self: self.engine.cache_tokens)
    max_concurrency = property(lambda self: self.engine.max_concurrency)
    mtp = property(lambda self: self.engine.mtp)       # the drafter is the target's own MTP head

    @classmethod
    def from_dirs(cls, target: str | Path, draft: str | Path | None = None, block_size: int | None = None,
                  cache_tokens: int = 32768, max_concurrency: int = 32, options: Exl3Options | None = None,
                  split: GpuSplit | None = None, max_chunk: int | None = None,
                  pair: ModelPair | None = None) -> Exl3Backend:
        """Load a target folder and an optional drafter folder (EXL3 or unquantized HF layout) onto the GPU(s):
        the target on GPU 0, or placed by `split` (runtime/placement.py), the drafter on split.draft_device.
        `max_chunk` (a multiple of 256): the longest forward this backend will run, when below exllamav3's 2048;
        the target loads measuring that much (less transient memory) and the Generator prefills no more at once."""
        pair = pair or ModelPair.read(target, draft)
        native = pair.block_size
        if block_size is not None and not 2 <= block_size <= max(native, 2):
            raise ToolkitError(f"block_size must be between 2 and the drafter's {native}, got {block_size}")
        engine = Exl3Engine.load(pair, cache_tokens, max_concurrency, split, max_chunk,
                                 (options or ADOPTED).forward_graphs)
        from ..runtime.hf import load_hf_tokenizer

        info = pair.info
        folders = (pair.target, pair.draft) if pair.draft is not None else (pair.target,)
        return cls(engine, load_hf_tokenizer(pair.target), info.max_context, info.eos_ids, options=options,
                   folders=folders, vocab_size=int(info.text.get("vocab_size") or 32000), split=split)

    def close(self) -> None:
        """Retire the generator and unload both models (the GPU memory comes back)."""
        self.engine.close()

    @classmethod
    def load(cls, pair: ModelPair, *, cache_tokens: int = 32768, max_concurrency: int = 32, options=None,
             split: GpuSplit | None = None, max_chunk: int | None = None, **host) -> Exl3Backend:
        """The factory's entry: the common load arguments (`host`: the torch backend's device and dtype, which
        exllamav3 does not take: it runs on the GPU(s) in fp16)."""
        return cls.from_dirs(pair.target, pair.draft, cache_tokens=cache_tokens, max_concurrency=max_concurrency,
                             options=options, split=split, max_chunk=max_chunk, pair=pair)

    def set_options(self, options: Exl3Options | None) -> None:
        """Use these options from the next generate on (None: ADOPTED); the Generator is rebuilt and the
        drafter's wraps follow."""
        options = options or ADOPTED
        if options.moe_levers or self.options.moe_levers:
            from .moe import install

            options = install(self.model, self.moe_class(), options)
        if self.draft is not None:
            set_draft_levers(self.draft, options, self.options, self.draft_classes)
        if options.forward_graphs or self.options.forward_graphs:
            from .graphs import set_forward_graphs

            from .moe import capture_refusal

            for name, model in (("target", self.model), ("draft", None if self.mtp else self.draft)):
                if model is not None:                 # (the MTP head's steps stay eager)
                    refuse = capture_refusal(model, self.moe_class()) if name == "target" else None
                    self._graphs[name] = set_forward_graphs(model, options.forward_graphs, self._graphs.get(name), refuse)
        if options != self.options:
            self.engine.retire()
        self.options = options

    def moe_class(self) -> type:
        if self._moe_class is None:
            self._moe_class = seams.get("BlockSparseMLP")
        return self._moe_class

    def sync(self) -> None:
        """Wait for the GPU (round timing)."""
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def generator(self, width: int, hooked: bool = True):
        """The engine's Generator for `width` drafts per round under these options (Exl3Engine.generator)."""
        return self.engine.generator(width, hooked, self.options)

    def _jobs(self, prompts: list[list[int]], settings: GenSettings) -> list:
        """exllamav3 Jobs of `prompts`, each checked against the context first."""
        self.check_prompts(prompts, settings.max_new_tokens)
        return self.engine.jobs(prompts, settings, list(self.stop_ids(settings)))

    # -- the policy --------------------------------------------------------------------------------------

    def prepare(self, settings: GenSettings, concurrency: int = 1) -> None:
        if settings.auto and self.draft_width(settings, True):
            self.book.table(concurrency)

    def policy(self, settings: GenSettings, concurrency: int = 1) -> Policy:
        """The policy of this pair, options and sampling mode (greedy or not), its costs covering `concurrency`."""
        return self.book.policy(settings.temperature <= 0, concurrency)

    def calibration_report(self) -> dict | None:
        return self.timing.tokens.get(self.options.tag)

    def engine_report(self) -> dict | None:
        """What the levers did so far: which MoE path the target's layers took ({"moe_paths": {"union": calls,
        "grouped": calls, "stock": calls}}, with an MoE lever on) and how each model's forwards ran ({"forward_graphs":
        {"target": ..., "draft": ...}}, once forward_graphs was on); None when neither applies."""
        out = {}
        if self.options.moe_levers:
            from .moe import path_counts

            out["moe_paths"] = path_counts(self.model, self.moe_class())
        if self._graphs:
            out["forward_graphs"] = {k: g.report() for k, g in self._graphs.items()}
        return out or None

    def plan(self, settings: GenSettings, speculative: bool) -> int | None:
        """The fixed verify width of a run (0 = AR), or None when the policy picks it per round."""
        if not speculative or self.block_size < 2 or self.draft is None:
            return 0
        return None if settings.auto else settings.fixed_block(self.block_size) - 1

    def generate_many(self, prompts: list[list[int]], settings: GenSettings, speculative: bool = True) -> Iterator[tuple[int, Round]]:
        """Decode several prompts as concurrent jobs of one generator; yields (prompt index, Round) as rounds finish."""
        width = self.plan(settings, speculative)
        jobs = self._jobs(prompts, settings)                     # every prompt is checked before any calibration
        if width is not None:
            return self.engine.run(prompts, jobs, width, None, self.options, self.clock)
        drive = self.book.request(settings.temperature <= 0, len(prompts), batching=True)
        # None: recent requests settled on AR, this one runs without the drafter at all
        return self.engine.run(prompts, jobs, 0, drive, self.options, self.clock)

    def decode_many(self, prompts: list[list[int]], jobs: list, width: int, policy: Policy | None = None
                    ) -> Iterator[tuple[int, Round]]:
        """Run exllamav3 jobs to the end: `width` drafts every round, or `policy`'s width for each round."""
        drive = Drive(policy, batching=True) if policy is not None else None
        return self.engine.run(prompts, jobs, width, drive, self.options, self.clock)

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        for _, r in self.generate_many([list(prompt_ids)], settings, speculative):
            yield r


class Exl3Costs:
    """The exllamav3 backend's round costs for its PolicyBook: t_round(w, c) timed on the loaded pair at first use
    of each job count c (calibrate.py), cached per model pair, GPU, options (and placement) and job count."""

    per_concurrency = True

    def __init__(self, be: Exl3Backend):
        self.be = be
        self.tokens: dict[str, dict[int, dict[int, float]]] = {}   # tag -> {c: {w: tokens a job emitted per round}}

    def key(self) -> CostKey:
        return CostKey(str(self.be.device), tuple(map(str, self.be.folders)), self.be.options.tag)

    def file_key(self, concurrency: int) -> str:
        """Cost cache key: model folders, GPU, block, options (and the placement, when not one GPU), concurrency
        and the table's version (calibrate.TABLE_VERSION)."""
        be = self.be
        tag = be.options.tag + ("" if be.split.default else f"|{be.split.tag}")
        tag = hashlib.sha256(tag.encode()).hexdigest()[:8]
        return f"{cost_key(be.folders, be.device, 'exl3', be.block_size)}-c{concurrency}-{tag}-v{TABLE_VERSION}"

    def measure(self, concurrency: int) -> CostTable:
        """A short calibration on dummy jobs (a cached table comes without its calibration's token counts)."""
        emitted: dict[int, float] = {}
        rounds: dict[int, int] = {}
        ms = calibrate(self.be, concurrency, emitted=emitted, rounds=rounds)
        self.tokens.setdefault(self.be.options.tag, {})[concurrency] = emitted
        return CostTable({concurrency: ms}, device_name(self.be.device), counts={concurrency: rounds},
                         timed_at=time.time())

    def check(self, concurrency: int) -> dict[int, dict[int, float]]:
        return {concurrency: spot_check(self.be, concurrency)}
