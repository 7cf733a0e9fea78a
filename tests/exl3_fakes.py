"""A small stand-in for exllamav3 1.6.5's Generator at the seam the exllamav3 backend uses (CPU tests).

It keeps the behaviour the backend relies on: each iterate() drafts `row_limited(num_draft_tokens)` ids (0 = a
plain decode step, no drafter call), the drafter computes its whole block whatever the window and hands back the
first `window` columns of a pinned buffer with spare rows, verification appends the accepted prefix plus one
token per job and records (position, window, accepted) in job.draft_stats. The target is `target_next`; the
drafter is right on the first `good(last token, block)` ids of its block. A fake clock advances by `cost(w, rows)`
ms per iterate so round timing is deterministic.
"""

from __future__ import annotations

import sys
import types

import torch

V = 97


def target_next(t: int) -> int:
    return (t * 7 + 3) % V


def ar_reference(prompt, n, stop=(5,)):
    out, t = [], prompt[-1]
    while len(out) < n:
        t = target_next(t)
        out.append(t)
        if t in stop:
            break
    return out


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Seq:
    def __init__(self, ids):
        self.ids = list(ids)

    def __len__(self):
        return len(self.ids)

    def torch_slice(self, a, b):
        return torch.tensor([self.ids[a:b]])

    def torch(self):
        return torch.tensor([self.ids])


class FakeJob:
    def __init__(self, input_ids, max_new_tokens, sampler, seed, stop_conditions, identifier):
        self.sequences = [types.SimpleNamespace(sequence_ids=Seq(input_ids[0].tolist()))]
        self.max_new_tokens, self.stop, self.new_tokens, self.draft_stats = max_new_tokens, set(stop_conditions), 0, []
        self.prefilled = False

    def is_prefill_done(self):
        return self.prefilled


class FakeGenerator:
    """exllamav3's loop in miniature: prefill in the first iterate, then one verify per job per iterate."""

    block = 7                                     # the drafter's B-1: computed whole every drafting round
    good = staticmethod(lambda last, block: last % (block + 2))
    cost = staticmethod(lambda w, rows: 10.0 + 2.0 * w * rows)
    spec_overhead = 0.0                           # ms every round of a Generator with a drafter costs more
    clock: Clock | None = None
    built: list = []                              # every constructed generator (class-level log)
    draft_step = "iterate_draftmodel_dflash_gen"  # the drafting step iterate() calls (exllamav3's, per drafter kind)

    def __init__(self, model, cache, tokenizer, max_batch_size=256, draft_model=None, draft_cache=None,
                 num_draft_tokens=0, record_draft_stats=False, draft_max_rows=0, **options):
        self.draft_model = draft_model
        self.num_draft_tokens = num_draft_tokens if draft_model is not None else 0
        self.max_draft_tokens = self.num_draft_tokens
        self.draft_max_rows, self.options = draft_max_rows, options
        self.dynamic_draft = bool(options.get("dynamic_draft_tokens"))
        self.record, self.active_jobs, self.iterations, self.widths = record_draft_stats, [], 0, []
        cache.owner_serial = self.cache_owner_serial = getattr(cache, "owner_serial", 0) + 1
        FakeGenerator.built.append(self)

    @property
    def window(self):
        return self.num_draft_tokens if self.draft_model is not None else 0

    def enqueue(self, jobs):
        self.active_jobs += jobs

    def num_remaining_jobs(self):
        return len(self.active_jobs)

    def clear_queue(self):
        self.active_jobs = []

    def close(self):
        pass

    def row_limited(self, window):
        if not self.draft_max_rows or not window:
            return window
        return min(window, max(0, self.draft_max_rows // max(len(self.active_jobs), 1) - 1))

    def iterate_draftmodel_dflash_gen(self, results, window):
        rows = []
        block = max(self.block, window)
        for job in self.active_jobs:                    # right on a prefix that depends on the last token
            last = job.sequences[0].sequence_ids.ids[-1]
            good, chain, t = self.good(last, block), [], last
            for k in range(block):
                t = target_next(t)
                chain.append(t if k < good else (t + 1) % V)
            rows.append(chain)
        return torch.tensor(rows + [[0] * block])[:, :window]    # pinned buffer: more rows than jobs

    def iterate(self):
        self.iterations += 1
        for job in self.active_jobs:
            job.prefilled = True
        window = self.row_limited(self.num_draft_tokens) if self.draft_model is not None else 0
        drafted = getattr(self, self.draft_step)([], window) if window else None
        w = drafted.shape[-1] if drafted is not None else 0
        self.widths.append(w)
        if self.clock is not None:
            self.clock.t += (self.cost(w, len(self.active_jobs)) + (self.spec_overhead if self.draft_model is not None else 0.0)) / 1000.0
        for j, job in enumerate(list(self.active_jobs)):
            ids = job.sequences[0].sequence_ids.ids
            accepted = 0
            for i in range(w + 1):
                t = target_next(ids[-1])
                ids.append(t)
                job.new_tokens += 1
                if t in job.stop or job.new_tokens >= job.max_new_tokens:
                    self.active_jobs.remove(job)
                    break
                if i == w or int(drafted[j, i]) != t:
                    break
                accepted += 1
            if w and self.record:
                job.draft_stats.append((job.new_tokens, w, accepted))
        return []


class FakeModel(list):
    """A model: its modules (iterated by the chunked_verify install), and unload()."""

    unloaded = False

    def __bool__(self):
        return True

    def unload(self):
        self.unloaded = True


class FakeTokenizer:
    chat_template = None

    def encode(self, text):
        return [(ord(c) % 89) + 6 for c in text[:12]] or [7]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def install_sampler_modules(monkeypatch) -> None:
    """The exllamav3 classes the backend imports by name: the two samplers it builds jobs with and the MoE layer
    class grouped_moe wraps (no stand-in model has one)."""
    sampler = types.ModuleType("exllamav3.generator.sampler")
    sampler.ArgmaxSampler = lambda: "argmax"
    sampler.CategoricalSampler = lambda temperature: f"T={temperature}"
    moe = types.ModuleType("exllamav3.modules.block_sparse_mlp")
    moe.BlockSparseMLP = type("BlockSparseMLP", (), {})
    for name in ("exllamav3", "exllamav3.generator", "exllamav3.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "exllamav3.generator.sampler", sampler)
    monkeypatch.setitem(sys.modules, "exllamav3.modules.block_sparse_mlp", moe)


def make_backend(monkeypatch, tmp_path, model=None, moe_class=None, cache_tokens=8192, **kw):
    """An Exl3Backend over the stand-in Generator (native block 8, EOS 5, up to 8 jobs), costs cached in tmp_path."""
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.exl3.engine import Exl3Engine

    install_sampler_modules(monkeypatch)
    monkeypatch.setattr(FakeGenerator, "built", [])
    exl = types.SimpleNamespace(Generator=FakeGenerator, Job=FakeJob)
    cache = types.SimpleNamespace(max_num_tokens=cache_tokens)
    engine = Exl3Engine(exl, FakeModel(model or []), cache, None, draft=FakeModel(), draft_cache="dc", block_size=8,
                        max_concurrency=8)
    return Exl3Backend(engine, FakeTokenizer(), max_context=4096, eos_ids=(5,), device="cpu",
                       cost_cache=tmp_path / "costs", moe_class=moe_class or type(None), **kw)

def timed_backend(monkeypatch, tmp_path, cost):
    """make_backend whose rounds cost `cost(width, rows)` ms on a shared stand-in clock (the backend's clock too)."""
    clock = Clock()
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(cost))
    be = make_backend(monkeypatch, tmp_path)
    be.clock = clock
    return be



# -- loading (Exl3Backend.from_dirs): exllamav3's Config / Model / Cache / Tokenizer, the calls recorded --------


class LoadedModel(FakeModel):
    """A model built from a folder; load(**kwargs) is recorded in `log` as (folder name, kwargs)."""

    def __init__(self, folder, log):
        super().__init__()
        self.folder, self.log, self.config = folder, log, folder
        self.modules, self.fwd_modules, self.logit_layer_idx = [], [], None     # what the load check reads

    def load(self, **kw):
        # exllamav3 1.6.5's layer-split loader measures over a (1, max_chunk_size) batch shape in the model's cache
        # (modules/attn.py: bsz * cache_max_seq_len <= cache.max_num_tokens); max_chunk_size defaults to 2048
        cache = getattr(self, "cache", None)
        if cache is not None:
            assert kw.get("max_chunk_size", 2048) <= cache.max_num_tokens, "Cache too small for batch shape"
        self.log.append((self.folder, {k: v for k, v in kw.items() if k != "draft_model"},
                         kw.get("draft_model") is not None))


def fake_loader(log: list):
    """An exllamav3 stand-in for from_dirs: models record their load arguments, caches keep their size."""
    return types.SimpleNamespace(
        Config=types.SimpleNamespace(from_directory=lambda d: d.rstrip("/").split("/")[-1]),
        Model=types.SimpleNamespace(from_config=lambda name: LoadedModel(name, log)),
        Cache=make_cache, Tokenizer=types.SimpleNamespace(from_config=lambda cfg: None),
        Generator=FakeGenerator, Job=FakeJob)


def make_cache(model, max_num_tokens, **kw):
    """A cache of max_num_tokens, attached to its model (as exllamav3 does) so load() can check the chunk fits."""
    cache = types.SimpleNamespace(max_num_tokens=max_num_tokens, model=model)
    model.cache = cache
    return cache


def install_loader(monkeypatch, devices: int, free_gib: float | list[float] = 80.0) -> list:
    """from_dirs on `devices` fake GPUs with `free_gib` free each (or per device); returns the load log."""
    from toolkit.runtime import placement as gpu_split
    from toolkit.exl3 import engine as exl3_engine

    log: list = []
    free = free_gib if isinstance(free_gib, list) else [free_gib] * max(devices, 1)
    install_sampler_modules(monkeypatch)
    monkeypatch.setattr(FakeGenerator, "built", [])
    monkeypatch.setattr(exl3_engine, "check_cuda", lambda: "FakeGPU")
    monkeypatch.setattr(exl3_engine, "import_exllamav3", lambda: fake_loader(log))
    monkeypatch.setattr(exl3_engine, "device_count", lambda: devices)
    monkeypatch.setattr(gpu_split, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(free[i] * 1024**3), 80 * 1024**3))
    return log
