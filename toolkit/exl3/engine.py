"""exllamav3's side of the exllamav3 backend: both models and their caches, the one Generator over them, jobs, and
the walk of a request's rounds (exl3/backend.py is the Backend face over it).

One Generator owns the target's cache. The hooked (recording, hook.py) speculative Generator is built once for
B-1 and takes any width per round; exllamav3's own Generator (hooked=False) is built for exactly one width; one
without drafter is the AR baseline. Each iterate() is one round of every active job; its Rounds are rebuilt from
the jobs' sequence ids and the hook's capture, and a policy's `Drive` (runtime/policy_book.py) picks its width.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator

from ..core.errors import ToolkitError
from ..runtime.backend import GenSettings
from ..runtime.events import Round
from ..runtime.pair import ModelPair
from ..runtime.placement import GpuSplit, device_count
from ..runtime.policy_book import Drive
from . import seams
from .calibrate import PAGE
from .hook import JobTrack, build_round, recording_generator_class, set_policy_width
from .loading import check_cuda, import_exllamav3, load_chunk, load_failure, load_models, settle_graphs_mode
from .memory import check_memory


class Exl3Engine:
    """A loaded target (and drafter) on exllamav3: `generator`, `jobs`, `run`, `close`."""

    def __init__(self, exl, model, cache, tokenizer, draft=None, draft_cache=None, block_size: int = 1,
                 max_concurrency: int = 32, max_chunk: int | None = None, mtp: bool = False):
        self.exl, self.model, self.cache, self.tokenizer = exl, model, cache, tokenizer
        self.mtp = mtp                    # the drafter is the target's own MTP head
        self.draft, self.draft_cache = draft, draft_cache
        self.block_size, self.max_concurrency = block_size, max_concurrency
        self.cache_tokens = cache.max_num_tokens
        self.max_chunk = max_chunk        # the Generator's longest prefill chunk (None: exllamav3's 2048)
        self.recording = recording_generator_class(exl.Generator)
        self.gen, self.gen_key = None, None

    @classmethod
    def load(cls, pair: ModelPair, cache_tokens: int = 32768, max_concurrency: int = 32, split: GpuSplit | None = None,
             max_chunk: int | None = None, forward_graphs: bool = False) -> Exl3Engine:
        """Load the pair's target and drafter onto the GPU(s) (Exl3Backend.from_dirs says how), one-line errors."""
        split = split or GpuSplit()
        target, draft = pair.target, pair.draft
        gpu = check_cuda()
        count = device_count()
        split.check_devices(count)
        settle_graphs_mode(forward_graphs)
        exl = import_exllamav3()
        if cache_tokens < PAGE or cache_tokens % PAGE:
            raise ToolkitError(f"cache_tokens must be a positive multiple of {PAGE}, got {cache_tokens}")
        if max_chunk is not None and (max_chunk < PAGE or max_chunk % PAGE):
            raise ToolkitError(f"max_chunk must be a positive multiple of {PAGE}, got {max_chunk}")
        mtp = pair.mtp is not None
        check_memory(target, draft, cache_tokens, max_concurrency, gpu, split, mtp=mtp)
        try:
            model, cache, dmodel, dcache = load_models(exl, target, draft, cache_tokens, max_concurrency,
                                                       max(pair.block_size - 1, 1), split, count, max_chunk, mtp=mtp)
            tok = exl.Tokenizer.from_config(model.config)
        except Exception as e:
            kind, why = load_failure(e) or (None, None)
            if kind == "memory":
                raise ToolkitError(f"not enough GPU memory on {gpu}: ran out while loading {target} (+ drafter), {why} GiB free now") from None
            if kind == "load":
                where = "" if split.default else f" ({split.tag})"
                raise ToolkitError(f"exllamav3 cannot load {target} / {'its MTP head' if mtp else draft}{where}: {why}") from None
            raise
        chunk = load_chunk(cache_tokens, max_chunk).get("max_chunk_size") if max_chunk else None
        return cls(exl, model, cache, tok, dmodel, dcache, pair.block_size, max_concurrency, chunk, mtp)

    def generator(self, width: int, hooked: bool = True, options: Hashable = None):
        """The one Generator that owns the cache, verifying `width` drafts per iterate (0 = plain AR, no drafter).

        The hooked (recording) speculative Generator is built once for B-1 and takes any width per round
        (`set_width`); exllamav3's own Generator (hooked=False) is built for exactly `width`. A Generator is
        rebuilt only when AR/speculative, the hook, or the `options` change."""
        spec = width > 0 and self.draft is not None
        key = (spec, hooked, options, width if spec and not hooked else None)
        g = self.gen
        if g is None or self.gen_key != key or getattr(self.cache, "owner_serial", None) != g.cache_owner_serial:
            if g is not None:
                g.close()
            cls = self.recording if hooked else self.exl.Generator
            kw = {}
            if spec:
                kw = dict(draft_model=self.draft, draft_cache=self.draft_cache, record_draft_stats=hooked,
                          num_draft_tokens=self.block_size - 1 if hooked else width)
            if self.max_chunk:
                kw["max_chunk_size"] = self.max_chunk
            g = self.gen = cls(self.model, self.cache, self.tokenizer, max_batch_size=self.max_concurrency, **kw)
            seams.check_instance("Generator", g)
            seams.check_instance("Cache", self.cache)          # the Generator has taken it over
            self.gen_key = key
        if spec and hooked:
            g.set_width(width)
        return g

    def retire(self) -> None:
        """Close the Generator (the next one is built at the next use)."""
        if self.gen is not None:
            self.gen.close()
            self.gen = None

    def close(self) -> None:
        """Retire the generator and unload both models (the GPU memory comes back)."""
        self.retire()
        for m in (self.draft, self.model):
            if m is not None:
                m.unload()

    def jobs(self, prompts: list[list[int]], settings: GenSettings, stop: list[int]) -> list:
        """exllamav3 Jobs of `prompts` (one-line errors when they exceed the concurrency or the cache)."""
        import torch

        if len(prompts) > self.max_concurrency:
            raise ToolkitError(f"{len(prompts)} jobs exceed max_concurrency {self.max_concurrency}")
        need = sum(-(-(len(p) + settings.max_new_tokens + self.block_size + 1) // PAGE) * PAGE for p in prompts)
        if need > self.cache_tokens:
            raise ToolkitError(f"{len(prompts)} jobs need about {need} cache tokens, the cache holds {self.cache_tokens} (raise cache_tokens)")
        sampler = seams.get("ArgmaxSampler")() if settings.temperature <= 0 else \
            seams.get("CategoricalSampler")(temperature=settings.temperature)
        jobs = [self.exl.Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=settings.max_new_tokens,
                             sampler=sampler, seed=settings.seed + i, stop_conditions=stop, identifier=i)
                for i, p in enumerate(prompts)]
        if jobs:                                   # what every round reads of them, checked before the first
            seams.check_instance("Job", jobs[0])
            seams.check_instance("Sequence", jobs[0].sequences[0])
        return jobs

    def run(self, prompts: list[list[int]], jobs: list, width: int, drive: Drive | None = None,
            options: Hashable = None, clock: Callable[[], float] = time.perf_counter) -> Iterator[tuple[int, Round]]:
        """Run exllamav3 jobs to the end under `options` (the Generator's key), rounds timed by `clock`: `width`
        drafts every round, or the drive's width for each round. (1) The policy learns nothing from the block
        exllamav3 verifies in a job's prefill iterate: on a GPU it never matched (one full miss per job, which crushed
        a batch's starting rates and kept 8 jobs on AR for their first rounds)."""
        B = self.block_size
        gen = self.generator(B - 1 if drive is not None else width, options=options)
        tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
        if drive is not None:
            for i, p in enumerate(prompts):
                drive.start(i, p[-1])
        gen.enqueue(jobs)
        try:
            while gen.num_remaining_jobs():
                if drive is not None:
                    set_policy_width(gen, drive, B - 1)
                t0 = clock()
                results = gen.iterate()
                t_round = (clock() - t0) * 1000.0
                for r in results:
                    if r.get("stage") == "error":
                        raise RuntimeError(f"exllamav3 job failed: {r.get('error')!r}")
                done, seen = [], []
                for job, tr in zip(jobs, tracks):
                    ids = job.sequences[0].sequence_ids
                    if len(ids) == tr.seen:
                        continue
                    new = ids.torch_slice(tr.seen, len(ids)).reshape(-1).tolist()
                    proposal = gen.proposals.get(id(job), ())
                    rnd = build_round(tr, new, job.draft_stats, gen.drafted.get(id(job)), gen.t_draft_ms, t_round,
                                      len(proposal))
                    if rnd is not None:
                        done.append((tr.index, rnd))
                        seen.append((tr.index, proposal if rnd.drafted and not rnd.prefill else (), rnd))  # (1)
                if drive is not None:
                    drive.observe(seen, t_round)
                yield from done
        finally:
            if gen.num_remaining_jobs():          # the consumer stopped early: free the jobs' pages
                gen.clear_queue()
            if drive is not None:
                drive.end()
