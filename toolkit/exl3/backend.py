"""The exllamav3 backend: an EXL3 (or unquantized) target and an EXL3 (or BF16) DFlash drafter on exllamav3 1.6.5,
or the target's own MTP head (`--draft mtp`: exllamav3's MTP component of a Qwen3.5/3.6 checkpoint, drafting up to
mtp.DEPTH ids a round, one head step each; its rounds are captured and verified the same way).

Decoding runs exllamav3's own Generator (paged cache, batched jobs, DFlash verification); the drafted ids of each
round come from the capture in hook.py. The AR baseline is a Generator over the same target and cache with no
drafter. exllamav3 is imported only when a backend is built, so this module imports on any machine.

The drafting policy (block_size "auto", the default; toolkit/policy) maps onto exllamav3's knobs as follows:
- before each iterate() the recording Generator's `num_draft_tokens` is set to the width the policy picks for the
  current number of jobs (one width for all: exllamav3 verifies a rectangle; 0 is a plain decode step). The
  drafter's block is computed whole, so the hook keeps all B-1 proposals for hindsight acceptance. One speculative
  Generator (built for B-1) serves every width; one without drafter is the AR baseline.
- a request runs on the AR baseline's Generator when the policy says drafting stopped paying (Policy.plain).
- t_round(w, c) is timed on the loaded model at first use of each concurrency c (calibrate.py) and cached per model
  pair, GPU and options: the policy's prior, corrected by the iterate() times it observes, over the timed widths.
- the levers (options.py) change what a round costs, never the width or the output.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..core.errors import ToolkitError
from ..runtime.backend import Backend, Capabilities, GenSettings
from ..runtime.events import Round
from ..runtime.pair import ModelPair
from . import seams
from .hook import JobTrack, build_round, recording_generator_class, set_policy_width
from .memory import GIB, cache_bytes, check_memory, weight_bytes  # noqa: F401  (re-exported)
from .draft_levers import set_draft_levers
from .options import ADOPTED, Exl3Options
from .calibrate import PAGE, TABLE_VERSION, calibrate, spot_check
from ..policy.chooser import Policy
from .loading import check_cuda, import_exllamav3, load_chunk, load_failure, load_models, settle_graphs_mode
from ..runtime.placement import GpuSplit, device_count
from ..costs.cache import cached_costs, cost_key, device_name
from ..costs.table import CostTable

class Exl3Backend(Backend):
    """Backend over exllamav3 models; `generate_many` runs several jobs in one generator."""

    name = "exllamav3"
    caps = Capabilities(batching=True, gpu_only=True, precision="float16", levers=Exl3Options, placement=True,
                        cache_tokens=True, width_multiple=128, engine="ExLlamaV3")

    @classmethod
    def installed(cls) -> bool:
        return seams.version() is not None
    clock = staticmethod(time.perf_counter)
    draft_classes: tuple[type, type] | None = None    # the drafter levers' module classes (None: exllamav3's)

    def __init__(self, exl, model, cache, tokenizer, hf_tokenizer, draft=None, draft_cache=None,
                 native_block: int = 1, max_context: int = 0, eos_ids: tuple[int, ...] = (), max_concurrency: int = 32,
                 *, options: Exl3Options | None = None, folders: Sequence[str | Path] = (), vocab_size: int = 32000,
                 device: str = "cuda", moe_class: type | None = None, cost_cache: str | Path | None = None,
                 split: GpuSplit | None = None, max_chunk: int | None = None, mtp: bool = False):
        self.exl, self.model, self.cache, self.tokenizer_exl = exl, model, cache, tokenizer
        self.mtp = mtp                    # the drafter is the target's own MTP head
        self.tokenizer, self.draft, self.draft_cache = hf_tokenizer, draft, draft_cache
        self.block_size, self.max_context, self.eos_ids = native_block, max_context, eos_ids
        self.max_concurrency, self.cache_tokens = max_concurrency, cache.max_num_tokens
        self.folders, self.vocab_size, self.device = tuple(folders), vocab_size, device
        self.cost_cache, self._moe_class = cost_cache, moe_class
        self.split = split or GpuSplit()
        self.max_chunk = max_chunk        # the Generator's longest prefill chunk (None: exllamav3's 2048)
        self._recording = recording_generator_class(exl.Generator)
        self._gen, self._gen_key = None, None
        self.options = Exl3Options()
        self._graphs: dict = {}           # each model's whole-forward graphs (forward_graphs), kept across toggles
        self.costs: dict[str, CostTable] = {}      # options tag -> its table, one concurrency added per calibration
        self.cost_files: dict[str, dict[int, CostTable]] = {}   # tag -> {c: the table cached_costs gave for c}
        self.calibration_tokens: dict[str, dict[int, dict[int, float]]] = {}   # tag -> {c: {w: tokens a job emitted per round}}
        self.policies: dict[tuple[bool, str], Policy] = {}    # (greedy, options tag) -> its policy
        self.learn_costs = True           # auto policies correct the calibrated costs by observed rounds
        self.retime_costs = False         # calibrate again instead of reading the cost cache
        self.set_options(options or ADOPTED)

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
        target, draft, info = pair.target, pair.draft, pair.info
        split = split or GpuSplit()
        native = pair.block_size
        if block_size is not None and not 2 <= block_size <= max(native, 2):
            raise ToolkitError(f"block_size must be between 2 and the drafter's {native}, got {block_size}")
        gpu = check_cuda()
        count = device_count()
        split.check_devices(count)
        settle_graphs_mode((options or ADOPTED).forward_graphs)
        exl = import_exllamav3()
        if cache_tokens < PAGE or cache_tokens % PAGE:
            raise ToolkitError(f"cache_tokens must be a positive multiple of {PAGE}, got {cache_tokens}")
        if max_chunk is not None and (max_chunk < PAGE or max_chunk % PAGE):
            raise ToolkitError(f"max_chunk must be a positive multiple of {PAGE}, got {max_chunk}")
        mtp = pair.mtp is not None
        check_memory(target, draft, cache_tokens, max_concurrency, gpu, split, mtp=mtp)
        try:
            model, cache, dmodel, dcache = load_models(exl, target, draft, cache_tokens, max_concurrency,
                                                       max(native - 1, 1), split, count, max_chunk, mtp=mtp)
            tok = exl.Tokenizer.from_config(model.config)
        except Exception as e:
            kind, why = load_failure(e) or (None, None)
            if kind == "memory":
                raise ToolkitError(f"not enough GPU memory on {gpu}: ran out while loading {target} (+ drafter), {why} GiB free now") from None
            if kind == "load":
                where = "" if split.default else f" ({split.tag})"
                raise ToolkitError(f"exllamav3 cannot load {target} / {'its MTP head' if mtp else draft}{where}: {why}") from None
            raise
        from ..runtime.hf import load_hf_tokenizer

        folders = (target, draft) if draft is not None else (target,)
        return cls(exl, model, cache, tok, load_hf_tokenizer(target), dmodel, dcache, native, info.max_context,
                   info.eos_ids, max_concurrency, options=options, folders=folders,
                   vocab_size=int(info.text.get("vocab_size") or 32000), split=split,
                   max_chunk=load_chunk(cache_tokens, max_chunk).get("max_chunk_size") if max_chunk else None, mtp=mtp)

    def close(self) -> None:
        """Retire the generator and unload both models (the GPU memory comes back)."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        for m in (self.draft, self.model):
            if m is not None:
                m.unload()

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
        if options != self.options and self._gen is not None:
            self._gen.close()
            self._gen = None
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
        """The one Generator that owns the cache, verifying `width` drafts per iterate (0 = plain AR, no drafter).

        The hooked (recording) speculative Generator is built once for B-1 and takes any width per round
        (`set_width`); exllamav3's own Generator (hooked=False) is built for exactly `width`. A Generator is
        rebuilt only when AR/speculative, the hook, or the options change."""
        spec = width > 0 and self.draft is not None
        key = (spec, hooked, self.options, width if spec and not hooked else None)
        g = self._gen
        if g is None or self._gen_key != key or getattr(self.cache, "owner_serial", None) != g.cache_owner_serial:
            if g is not None:
                g.close()
            cls = self._recording if hooked else self.exl.Generator
            kw = {}
            if spec:
                kw = dict(draft_model=self.draft, draft_cache=self.draft_cache, record_draft_stats=hooked,
                          num_draft_tokens=self.block_size - 1 if hooked else width)
            if self.max_chunk:
                kw["max_chunk_size"] = self.max_chunk
            g = self._gen = cls(self.model, self.cache, self.tokenizer_exl, max_batch_size=self.max_concurrency, **kw)
            seams.check_instance("Generator", g)
            seams.check_instance("Cache", self.cache)          # the Generator has taken it over
            self._gen_key = key
        if spec and hooked:
            g.set_width(width)
        return g

    # -- the policy --------------------------------------------------------------------------------------

    def cost_file_key(self, concurrency: int) -> str:
        """Cost cache key: model folders, GPU, block, options (and the placement, when not one GPU), concurrency
        and the table's version (exl3_calibrate.TABLE_VERSION)."""
        tag = self.options.tag + ("" if self.split.default else f"|{self.split.tag}")
        tag = hashlib.sha256(tag.encode()).hexdigest()[:8]
        return f"{cost_key(self.folders, self.device, 'exl3', self.block_size)}-c{concurrency}-{tag}-v{TABLE_VERSION}"

    def cost_table(self, concurrency: int) -> CostTable:
        """t_round(w, c) for every concurrency measured so far with these options, timing `concurrency` first
        if it is new (a short calibration on dummy jobs, cached on disk)."""
        tag = self.options.tag
        table = self.costs.get(tag)
        if table is None or concurrency not in table.ms:
            def measure() -> CostTable:             # a cached table comes without its calibration's token counts
                emitted: dict[int, float] = {}
                rounds: dict[int, int] = {}
                ms = calibrate(self, concurrency, emitted=emitted, rounds=rounds)
                self.calibration_tokens.setdefault(tag, {})[concurrency] = emitted
                return CostTable({concurrency: ms}, device_name(self.device), counts={concurrency: rounds},
                                 timed_at=time.time())

            got = cached_costs(self.cost_file_key(concurrency), measure, self.cost_cache, refresh=self.retime_costs,
                               check=lambda: {concurrency: spot_check(self, concurrency)})
            ms = got.ms.get(concurrency) or next(iter(got.ms.values()))
            files = self.cost_files.setdefault(tag, {})
            if table is None:                       # one table per options, one cache file per concurrency
                table = self.costs[tag] = CostTable({concurrency: ms}, got.device, got.source, timed_at=got.timed_at,
                                                    on_disagree=lambda c, why: tell(files.get(c), c, why))
            table.ms[concurrency] = ms              # the policies of this tag read the same table
            table.counts[concurrency] = got.counts.get(concurrency) or next(iter(got.counts.values()), {})
            files[concurrency] = got
        return table

    def prepare(self, settings: GenSettings, concurrency: int = 1) -> None:
        if settings.auto and self.draft_width(settings, True):
            self.cost_table(concurrency)

    def policy(self, settings: GenSettings, concurrency: int = 1) -> Policy:
        """The policy of this pair, options and sampling mode (greedy or not), its costs covering `concurrency`."""
        table = self.cost_table(concurrency)
        key = (settings.temperature <= 0, self.options.tag)
        if key not in self.policies:
            self.policies[key] = Policy.auto(self.block_size, table, learn_costs=self.learn_costs)
        return self.policies[key]

    def auto_policy(self, settings: GenSettings) -> Policy | None:
        return self.policies.get((settings.temperature <= 0, self.options.tag))

    def cost_source(self) -> str | None:
        return getattr(self.costs.get(self.options.tag), "source", None)    # timed by prepare(), before any policy

    def calibration_report(self) -> dict | None:
        return self.calibration_tokens.get(self.options.tag)

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

    def _jobs(self, prompts: list[list[int]], settings: GenSettings) -> list:
        import torch

        self.check_prompts(prompts, settings.max_new_tokens)
        if len(prompts) > self.max_concurrency:
            raise ToolkitError(f"{len(prompts)} jobs exceed max_concurrency {self.max_concurrency}")
        need = sum(-(-(len(p) + settings.max_new_tokens + self.block_size + 1) // PAGE) * PAGE for p in prompts)
        if need > self.cache_tokens:
            raise ToolkitError(f"{len(prompts)} jobs need about {need} cache tokens, the cache holds {self.cache_tokens} (raise cache_tokens)")
        sampler = seams.get("ArgmaxSampler")() if settings.temperature <= 0 else \
            seams.get("CategoricalSampler")(temperature=settings.temperature)
        stop = list(self.stop_ids(settings))
        jobs = [self.exl.Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=settings.max_new_tokens,
                             sampler=sampler, seed=settings.seed + i, stop_conditions=stop, identifier=i)
                for i, p in enumerate(prompts)]
        if jobs:                                   # what every round reads of them, checked before the first
            seams.check_instance("Job", jobs[0])
            seams.check_instance("Sequence", jobs[0].sequences[0])
        return jobs

    def generate_many(self, prompts: list[list[int]], settings: GenSettings, speculative: bool = True) -> Iterator[tuple[int, Round]]:
        """Decode several prompts as concurrent jobs of one generator; yields (prompt index, Round) as rounds finish."""
        width = self.plan(settings, speculative)
        jobs = self._jobs(prompts, settings)                     # every prompt is checked before any calibration
        policy = self.policy(settings, len(prompts)) if width is None else None
        if policy is not None and policy.plain(len(prompts)):
            return self.decode_many(prompts, jobs, 0)            # recent requests settled on AR: no drafter at all
        return self.decode_many(prompts, jobs, width or 0, policy)

    def decode_many(self, prompts: list[list[int]], jobs: list, width: int, policy: Policy | None = None
                    ) -> Iterator[tuple[int, Round]]:
        """Run exllamav3 jobs to the end: `width` drafts every round, or the policy's width for each round. (1) The
        policy learns nothing from the block exllamav3 verifies in a job's prefill iterate: on a GPU it never matched
        (one full miss per job, which crushed a batch's starting rates and kept 8 jobs on AR for their first rounds)."""
        B = self.block_size
        gen = self.generator(B - 1 if policy is not None else width)
        tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
        if policy is not None:
            for i, p in enumerate(prompts):
                policy.start(i, p[-1])
        gen.enqueue(jobs)
        try:
            while gen.num_remaining_jobs():
                if policy is not None:
                    set_policy_width(gen, policy, B - 1)
                t0 = self.clock()
                results = gen.iterate()
                t_round = (self.clock() - t0) * 1000.0
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
                if policy is not None:
                    policy.observe(seen, t_round)
                yield from done
        finally:
            if gen.num_remaining_jobs():          # the consumer stopped early: free the jobs' pages
                gen.clear_queue()
            if policy is not None:
                for i in range(len(prompts)):
                    policy.finish(i)
                policy.end_request(len(prompts))

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        for _, r in self.generate_many([list(prompt_ids)], settings, speculative):
            yield r


def tell(got: CostTable | None, concurrency: int, why: str) -> None:
    """Pass the policy's word that live rounds disagree with the table of `concurrency` to that table's cache."""
    if got is not None and got.on_disagree is not None:
        got.on_disagree(concurrency, why)
