"""The exllamav3 backend: an EXL3 (or unquantized) target and an EXL3 (or BF16) DFlash drafter on exllamav3 1.6.5.

Decoding runs exllamav3's own Generator (paged cache, batched jobs, DFlash verification); the drafted ids of
each round come from the capture in exl3_hook. The AR baseline is a Generator over the same target and the
same cache with no drafter. exllamav3 is imported only when a backend is built, so this module imports on
any machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

from ..core.errors import ToolkitError
from .backend import GenSettings, encode_chat
from .events import Round
from .exl3_hook import JobTrack, build_round, check_version, exllamav3_version, recording_generator_class

PAGE = 256            # exllamav3's cache page size
GIB = 1024**3
MIN_CAPABILITY = (8, 0)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


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
    cfg = read_json(folder / "config.json")
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    if "quantization_config" in cfg:
        return size
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return size // 2 if "32" in dtype else size


def cache_bytes(cfg: dict, tokens: int, slots: int) -> int:
    """K/V bytes for `tokens` positions over the attention layers of a config, plus recurrent state for `slots` jobs."""
    t = cfg.get("text_config") or cfg
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
    c = cache_bytes(read_json(target / "config.json"), tokens, slots)
    if draft:
        c += cache_bytes(read_json(draft / "config.json"), tokens, slots)
    need = w + c + GIB // 2
    if need > free:
        raise ToolkitError(
            f"not enough GPU memory on {gpu}: loading needs about {need / GIB:.1f} GiB (weights {w / GIB:.1f}, "
            f"caches of {tokens} tokens {c / GIB:.1f}, reserve 0.5), {free / GIB:.1f} GiB is free"
        )


class Exl3Backend:
    """Backend over exllamav3 models (see runtime.backend.Backend); `generate_many` runs several jobs in one generator."""

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
        self.iterations, self.seconds = 0, 0.0   # iterate() calls and wall time (after enqueue) of the last generate_many
        self.overhead_s = 0.0                    # of which our capture and Round assembly (consumer time excluded)

    @classmethod
    def from_dirs(cls, target: str | Path, draft: str | Path | None = None, block_size: int | None = None,
                  cache_tokens: int = 32768, max_concurrency: int = 32, **_) -> "Exl3Backend":
        """Load a target folder and an optional drafter folder (EXL3 or unquantized HF layout) onto the GPU."""
        from ..dflash import DFlashConfig

        target, draft = Path(target), Path(draft) if draft is not None else None
        tcfg = read_json(target / "config.json")
        if not tcfg:
            raise ToolkitError(f"{target}: no config.json (not a model folder)")
        dconf = None
        if draft is not None:
            dconf = DFlashConfig.from_dir(draft)
            try:
                dconf.validate_against(tcfg)
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
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(str(target))
        gen = read_json(target / "generation_config.json")
        eos = gen.get("eos_token_id", tcfg.get("eos_token_id", hf_tok.eos_token_id))
        eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        ctx = int((tcfg.get("text_config") or tcfg).get("max_position_embeddings") or 1 << 20)
        return cls(exl, model, cache, tok, hf_tok, dmodel, dcache, native, ctx, eos_ids, max_concurrency)

    def close(self) -> None:
        """Retire the generator and unload both models (the GPU memory comes back)."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        for m in (self.draft, self.model):
            if m is not None:
                m.unload()

    # -- tokens --------------------------------------------------------------------------------------

    def encode(self, prompt: str, system: str | None = None, thinking: bool | None = None) -> list[int]:
        return encode_chat(self.tokenizer, prompt, system, thinking)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- decoding ------------------------------------------------------------------------------------

    def draft_width(self, settings: GenSettings, speculative: bool) -> int:
        if not speculative or self.draft is None:
            return 0
        return min(settings.block_size or self.block_size, self.block_size) - 1

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

        if not prompts or any(not p for p in prompts):
            raise ToolkitError("prompt is empty")
        if len(prompts) > self.max_concurrency:
            raise ToolkitError(f"{len(prompts)} jobs exceed max_concurrency {self.max_concurrency}")
        longest = max(len(p) for p in prompts) + settings.max_new_tokens
        if longest > self.max_context:
            raise ToolkitError(f"prompt + {settings.max_new_tokens} new tokens = {longest} exceeds the context of {self.max_context}")
        need = sum(-(-(len(p) + settings.max_new_tokens + self.block_size + 1) // PAGE) * PAGE for p in prompts)
        if need > self.cache_tokens:
            raise ToolkitError(f"{len(prompts)} jobs need about {need} cache tokens, the cache holds {self.cache_tokens} (raise cache_tokens)")
        from exllamav3.generator.sampler import ArgmaxSampler, CategoricalSampler

        sampler = ArgmaxSampler() if settings.temperature <= 0 else CategoricalSampler(temperature=settings.temperature)
        stop = list(settings.stop_ids if settings.stop_ids is not None else self.eos_ids)
        return [
            self.exl.Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=settings.max_new_tokens,
                         sampler=sampler, seed=settings.seed + i, stop_conditions=stop, identifier=i)
            for i, p in enumerate(prompts)
        ]

    def generate_many(self, prompts: list[list[int]], settings: GenSettings, speculative: bool = True) -> Iterator[tuple[int, Round]]:
        """Decode several prompts as concurrent jobs of one generator; yields (prompt index, Round) as rounds finish."""
        width = self.draft_width(settings, speculative)
        gen = self.generator(width)
        jobs = self._jobs(prompts, settings)
        tracks = [JobTrack(i, len(p)) for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        self.iterations, self.overhead_s, start = 0, 0.0, time.perf_counter()
        consumer = 0.0
        try:
            while gen.num_remaining_jobs():
                t0 = time.perf_counter()
                results = gen.iterate()
                t1 = time.perf_counter()
                self.iterations += 1
                t_round = (t1 - t0) * 1000.0
                for r in results:
                    if r.get("stage") == "error":
                        raise RuntimeError(f"exllamav3 job failed: {r.get('error')!r}")
                done = []
                for job, tr in zip(jobs, tracks):
                    ids = job.sequences[0].sequence_ids
                    n = len(ids)
                    if n == tr.seen:
                        continue
                    new = ids.torch_slice(tr.seen, n).reshape(-1).tolist()
                    rnd = build_round(tr, new, job.draft_stats, gen.drafted.get(id(job)), gen.t_draft_ms, t_round)
                    if rnd is not None:
                        done.append((tr.index, rnd))
                self.overhead_s += time.perf_counter() - t1 + getattr(gen, "capture_s", 0.0)
                t2 = time.perf_counter()
                yield from done
                consumer += time.perf_counter() - t2
        finally:
            self.seconds = time.perf_counter() - start - consumer
            if gen.num_remaining_jobs():          # the consumer stopped early: free the jobs' pages
                gen.clear_queue()

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        for _, r in self.generate_many([list(prompt_ids)], settings, speculative):
            yield r

    def generate_plain(self, prompts: list[list[int]], settings: GenSettings, speculative: bool = True,
                       hooked: bool = False) -> tuple[list[list[int]], float, int]:
        """A bare iterate() loop with no Round assembly: (emitted ids per job, seconds, iterations), for overhead checks.
        hooked=False runs the library's own Generator; True the capturing subclass."""
        gen = self.generator(self.draft_width(settings, speculative), hooked=hooked)
        jobs = self._jobs(prompts, settings)
        gen.enqueue(jobs)
        t0, steps = time.perf_counter(), 0
        while gen.num_remaining_jobs():
            gen.iterate()
            steps += 1
        secs = time.perf_counter() - t0
        out = [j.sequences[0].sequence_ids.torch().reshape(-1).tolist()[len(p):] for j, p in zip(jobs, prompts)]
        return out, secs, steps
