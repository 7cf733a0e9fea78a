"""The exllamav3 backend: an EXL3 (or unquantized) target and an EXL3 (or BF16) DFlash drafter on exllamav3 1.6.5.

Decoding runs exllamav3's own Generator (paged cache, batched jobs, DFlash verification); the drafted ids of
each round come from the capture in exl3_hook. The AR baseline is a Generator over the same target and the
same cache with no drafter. exllamav3 is imported only when a backend is built, so this module imports on
any machine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from ..core.errors import ToolkitError
from ..core.target import TargetInfo, read_optional
from .backend import Backend, GenSettings
from .events import Round
from .exl3_hook import JobTrack, build_round, check_version, exllamav3_version, recording_generator_class

PAGE = 256            # exllamav3's cache page size
GIB = 1024**3
MIN_CAPABILITY = (8, 0)


def check_cuda() -> str:
    """The GPU's name, or a one-line ToolkitError saying which GPU the backend needs."""
    import torch

    need = f"an NVIDIA GPU with CUDA, compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ampere, Ada, Hopper, Blackwell)"
    if not torch.cuda.is_available():
        raise ToolkitError(f"no CUDA GPU found: the exllamav3 backend needs {need}; use --backend torch on CPU")
    name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    if tuple(cap) < MIN_CAPABILITY:
        raise ToolkitError(f"{name} has compute capability {cap[0]}.{cap[1]}: the exllamav3 backend needs {need}")
    return name


def import_exllamav3():
    """exllamav3, after checking it is installed at the pinned version (its import builds or loads the CUDA extension)."""
    check_version(exllamav3_version())
    try:
        import exllamav3
    except ImportError as e:
        raise ToolkitError(f"exllamav3 is installed but does not import ({str(e).splitlines()[0]})") from None
    return exllamav3


def weight_bytes(folder: Path) -> int:
    """Bytes the folder's weights take once loaded: EXL3 tensors as stored, unquantized ones as fp16."""
    info = TargetInfo(read_optional(folder / "config.json"))
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    if info.exl3:
        return size
    dtype = str(info.config.get("torch_dtype") or info.config.get("dtype") or "bfloat16")
    return size // 2 if "32" in dtype else size


def cache_bytes(cfg: dict, tokens: int, slots: int) -> int:
    """K/V bytes for `tokens` positions over the attention layers of a config, plus recurrent state for `slots` jobs."""
    t = TargetInfo(cfg).text
    layers = int(t.get("num_hidden_layers", 0))
    types = t.get("layer_types") or ["full_attention"] * layers
    heads = int(t.get("num_attention_heads", 1))
    kv, hd = int(t.get("num_key_value_heads", heads)), int(t.get("head_dim") or t.get("hidden_size", 0) // heads)
    attn = sum(1 for x in types if x in ("full_attention", "sliding_attention"))
    total = attn * 2 * kv * hd * 2 * tokens
    lin = len(types) - attn
    if lin:
        vh, kd, vd = (int(t.get(k, 0)) for k in ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
        total += lin * vh * kd * vd * 2 * 2 * slots
    return total


def check_memory(target: Path, draft: Path | None, tokens: int, slots: int, gpu: str) -> None:
    """Refuse to load, in one line, when the weights and caches plainly do not fit the free GPU memory."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    w = weight_bytes(target) + (weight_bytes(draft) if draft else 0)
    c = cache_bytes(read_optional(target / "config.json"), tokens, slots)
    if draft:
        c += cache_bytes(read_optional(draft / "config.json"), tokens, slots)
    need = w + c + GIB // 2
    if need > free:
        raise ToolkitError(
            f"not enough GPU memory on {gpu}: loading needs about {need / GIB:.1f} GiB (weights {w / GIB:.1f}, "
            f"caches of {tokens} tokens {c / GIB:.1f}, reserve 0.5), {free / GIB:.1f} GiB is free"
        )


class Exl3Backend(Backend):
    """Backend over exllamav3 models; `generate_many` runs several jobs in one generator."""

    name = "exllamav3"

    def __init__(self, exl, model, cache, tokenizer, hf_tokenizer, draft=None, draft_cache=None,
                 native_block: int = 1, max_context: int = 0, eos_ids: tuple[int, ...] = (), max_concurrency: int = 32):
        self.exl, self.model, self.cache, self.tokenizer_exl = exl, model, cache, tokenizer
        self.tokenizer, self.draft, self.draft_cache = hf_tokenizer, draft, draft_cache
        self.block_size, self.max_context, self.eos_ids = native_block, max_context, eos_ids
        self.max_concurrency = max_concurrency
        self.cache_tokens = cache.max_num_tokens
        self._recording = recording_generator_class(exl.Generator)
        self._gen, self._gen_key = None, None

    @classmethod
    def from_dirs(cls, target: str | Path, draft: str | Path | None = None, block_size: int | None = None,
                  cache_tokens: int = 32768, max_concurrency: int = 32) -> "Exl3Backend":
        """Load a target folder and an optional drafter folder (EXL3 or unquantized HF layout) onto the GPU."""
        from ..dflash import DFlashConfig

        target, draft = Path(target), Path(draft) if draft is not None else None
        info = TargetInfo.read(target)
        dconf = None
        if draft is not None:
            dconf = DFlashConfig.from_dir(draft)
            try:
                dconf.validate_against(info.config)
            except ToolkitError as e:
                raise ToolkitError(f"drafter {draft} does not fit target {target}: {e}") from None
        native = dconf.block_size if dconf else 1
        if block_size is not None and not 2 <= block_size <= max(native, 2):
            raise ToolkitError(f"block_size must be between 2 and the drafter's {native}, got {block_size}")
        gpu = check_cuda()
        exl = import_exllamav3()
        if cache_tokens < PAGE or cache_tokens % PAGE:
            raise ToolkitError(f"cache_tokens must be a positive multiple of {PAGE}, got {cache_tokens}")
        check_memory(target, draft, cache_tokens, max_concurrency, gpu)
        history = max(native - 1, 1)
        try:
            model = exl.Model.from_config(exl.Config.from_directory(str(target)))
            cache = exl.Cache(model, max_num_tokens=cache_tokens, max_batch_size=max_concurrency, max_history=history)
            dmodel = dcache = None
            if draft is not None:            # every cache before any load, the drafter before the target
                dmodel = exl.Model.from_config(exl.Config.from_directory(str(draft)))
                dcache = exl.Cache(dmodel, max_num_tokens=cache_tokens, max_batch_size=max_concurrency, max_history=history)
                dmodel.load(progressbar=False)
            model.load(progressbar=False, **({"draft_model": dmodel} if dmodel is not None else {}))
            tok = exl.Tokenizer.from_config(model.config)
        except Exception as e:
            import torch

            if isinstance(e, torch.OutOfMemoryError):
                free = torch.cuda.mem_get_info()[0] / GIB
                raise ToolkitError(f"not enough GPU memory on {gpu}: ran out while loading {target} (+ drafter), {free:.1f} GiB free now") from None
            if isinstance(e, (AssertionError, ValueError, KeyError, OSError)):
                raise ToolkitError(f"exllamav3 cannot load {target} / {draft}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            raise
        from .torch_backend import load_hf_tokenizer

        return cls(exl, model, cache, tok, load_hf_tokenizer(target), dmodel, dcache, native, info.max_context,
                   info.eos_ids, max_concurrency)

    def close(self) -> None:
        """Retire the generator and unload both models (the GPU memory comes back)."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        for m in (self.draft, self.model):
            if m is not None:
                m.unload()

    def generator(self, width: int, hooked: bool = True):
        """The one Generator that owns the cache, rebuilt when the draft width or the hook changes."""
        key = (width, hooked)
        g = self._gen
        if g is not None and self._gen_key == key and getattr(self.cache, "owner_serial", None) == g.cache_owner_serial:
            return g
        if g is not None:
            g.close()
        cls = self._recording if hooked else self.exl.Generator
        kw = {}
        if width:
            kw = dict(draft_model=self.draft, draft_cache=self.draft_cache, num_draft_tokens=width, record_draft_stats=hooked)
        self._gen = cls(self.model, self.cache, self.tokenizer_exl, max_batch_size=self.max_concurrency, **kw)
        self._gen_key = key
        return self._gen

    def _jobs(self, prompts: list[list[int]], settings: GenSettings) -> list:
        import torch

        self.check_prompts(prompts, settings.max_new_tokens)
        if len(prompts) > self.max_concurrency:
            raise ToolkitError(f"{len(prompts)} jobs exceed max_concurrency {self.max_concurrency}")
        need = sum(-(-(len(p) + settings.max_new_tokens + self.block_size + 1) // PAGE) * PAGE for p in prompts)
        if need > self.cache_tokens:
            raise ToolkitError(f"{len(prompts)} jobs need about {need} cache tokens, the cache holds {self.cache_tokens} (raise cache_tokens)")
        from exllamav3.generator.sampler import ArgmaxSampler, CategoricalSampler

        sampler = ArgmaxSampler() if settings.temperature <= 0 else CategoricalSampler(temperature=settings.temperature)
        stop = list(self.stop_ids(settings))
        return [
            self.exl.Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=settings.max_new_tokens,
                         sampler=sampler, seed=settings.seed + i, stop_conditions=stop, identifier=i)
            for i, p in enumerate(prompts)
        ]

    def generate_many(self, prompts: list[list[int]], settings: GenSettings, speculative: bool = True) -> Iterator[tuple[int, Round]]:
        """Decode several prompts as concurrent jobs of one generator; yields (prompt index, Round) as rounds finish."""
        gen = self.generator(self.draft_width(settings, speculative))
        jobs = self._jobs(prompts, settings)
        tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        try:
            while gen.num_remaining_jobs():
                t0 = time.perf_counter()
                results = gen.iterate()
                t_round = (time.perf_counter() - t0) * 1000.0
                for r in results:
                    if r.get("stage") == "error":
                        raise RuntimeError(f"exllamav3 job failed: {r.get('error')!r}")
                done = []
                for job, tr in zip(jobs, tracks):
                    ids = job.sequences[0].sequence_ids
                    if len(ids) == tr.seen:
                        continue
                    new = ids.torch_slice(tr.seen, len(ids)).reshape(-1).tolist()
                    rnd = build_round(tr, new, job.draft_stats, gen.drafted.get(id(job)), gen.t_draft_ms, t_round)
                    if rnd is not None:
                        done.append((tr.index, rnd))
                yield from done
        finally:
            if gen.num_remaining_jobs():          # the consumer stopped early: free the jobs' pages
                gen.clear_queue()

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        for _, r in self.generate_many([list(prompt_ids)], settings, speculative):
            yield r
