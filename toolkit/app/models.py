"""Which backend and models the app runs: flags > env vars > the embedded demo pair; Space hardware aware.

Env vars: DFLASH_TARGET, DFLASH_DRAFT (local folders or Hub refs USER/NAME[@REVISION], e.g. a quant branch
@4.0bpw, fetched through core.refs), DFLASH_BACKEND (auto|torch|exllamav3), DFLASH_DEVICE, DFLASH_DEMO
(smollm2|tiny: which embedded pair runs when no models are given; smollm2 falls back to tiny when its target
cannot be prepared offline), and for the exllamav3 backend on several GPUs DFLASH_GPU_SPLIT (auto|GB,GB,...),
DFLASH_TENSOR_PARALLEL (1/0), DFLASH_DRAFT_DEVICE (N) (runtime/gpu_split.py). On a Space, SPACE_ID and
ACCELERATOR ("none"/"cpu-basic" = CPU) pick the hardware.
Loading never raises: a failure is kept as a message that the page shows.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..core.errors import ToolkitError
from ..core.refs import fetch, parse_ref
from ..runtime.backend import Backend
from ..runtime.factory import load_backend
from ..runtime.gpu_split import ENV, GpuSplit, from_env

log = logging.getLogger("toolkit.app")
BACKENDS = ("auto", "torch", "exllamav3")


@dataclass
class Hardware:
    """Where the app runs: a Space or not, and which accelerator it has."""

    space_id: str | None = None
    accelerator: str | None = None
    cuda: bool = False
    zero_gpu: bool = False

    @classmethod
    def detect(cls, env: dict | None = None) -> "Hardware":
        env = os.environ if env is None else env
        acc = (env.get("ACCELERATOR") or "").strip().lower() or None
        zero = env.get("SPACES_ZERO_GPU", "").lower() in ("1", "true") or bool(acc and acc.startswith("zero"))
        cpu_space = acc is not None and (acc == "none" or acc.startswith("cpu"))
        return cls(env.get("SPACE_ID") or None, acc, (not cpu_space) and cuda_available(), zero)

    def label(self) -> str:
        where = f"Space {self.space_id}" if self.space_id else "local"
        hw = self.accelerator or ("GPU" if self.cuda else "CPU")
        return f"{where}, {hw}{' (ZeroGPU)' if self.zero_gpu else ''}"


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install must not stop the CPU app
        return False


@dataclass
class ModelSpec:
    """What to load. target None = the embedded demo pair."""

    target: str | None = None
    draft: str | None = None
    backend: str = "auto"
    device: str | None = None
    split: GpuSplit = field(default_factory=GpuSplit)     # exllamav3: the target across GPUs, the drafter's GPU

    @classmethod
    def resolve(cls, target=None, draft=None, backend=None, device=None, env: dict | None = None,
                defaults: dict | None = None) -> "ModelSpec":
        """Flags, else env vars, else `defaults` (an exported Space's space.json), else the demo."""
        env = os.environ if env is None else env
        d = defaults or {}
        spec = cls(target or env.get("DFLASH_TARGET") or d.get("target") or None,
                   draft or env.get("DFLASH_DRAFT") or d.get("draft") or None,
                   (backend or env.get("DFLASH_BACKEND") or d.get("backend") or "auto").lower(),
                   device or env.get("DFLASH_DEVICE") or None, split_of(env, d))
        if spec.backend not in BACKENDS:
            raise ToolkitError(f"backend must be one of {', '.join(BACKENDS)}, got {spec.backend!r}")
        return spec

    @property
    def demo(self) -> bool:
        return self.target is None


def split_of(env, defaults: dict) -> GpuSplit:
    """The GPU split from DFLASH_GPU_SPLIT / DFLASH_TENSOR_PARALLEL / DFLASH_DRAFT_DEVICE, else space.json's
    gpu_split / tensor_parallel / draft_device, else one GPU."""
    vals = {}
    for key, var in ENV.items():
        v = env.get(var) if (env.get(var) or "").strip() else defaults.get(key)
        if v is not None and v != "":
            vals[var] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    return from_env(vals)


@dataclass
class Loaded:
    """The loaded backend (or None and the reason), and what the page says about it."""

    backend: Backend | None
    error: str | None = None
    demo: bool = False
    backend_name: str = ""
    device: str = "cpu"
    target: str = ""
    draft: str = ""
    notes: list[str] = field(default_factory=list)
    hardware: Hardware = field(default_factory=Hardware)
    demo_kind: str = ""               # "smollm2" or "tiny" when demo

    @property
    def block_size(self) -> int:
        """The drafter's block size; 16 (the page's default) while nothing is loaded."""
        return self.backend.block_size if self.backend is not None else 16

    @property
    def max_context(self) -> int:
        return self.backend.max_context if self.backend is not None else 4096

    @property
    def thinking(self) -> bool:
        """Whether the target's chat template has a thinking switch (Qwen3 / Qwen3.5 / Qwen3.6)."""
        return self.backend is not None and self.backend.supports_thinking


def fetch_model(ref: str, what: str) -> tuple[str, str]:
    """(local folder, how the page names it): a folder as is; a Hub ref `USER/NAME[@REVISION]` fetched at that
    revision through core.refs (HF_ENDPOINT read now), named with the branch and the commit sha it resolved to."""
    try:
        parsed = parse_ref(ref)
        path, sha = fetch(parsed)
    except ToolkitError as e:                    # one line for the page, naming the model it is about
        raise ToolkitError(f"{what}: {e}") from None
    if sha is None:
        return str(path), ref
    named = f"{parsed.repo}@{parsed.revision or 'main'} (commit {sha[:12]})"
    say(f"{what} {named}: {path}")
    return str(path), named


def choose_backend(spec: ModelSpec, hw: Hardware) -> tuple[str, str, list[str]]:
    """(backend, device, notes). exllamav3 needs CUDA; without it the torch backend runs on CPU."""
    notes: list[str] = []
    has_exl = importlib.util.find_spec("exllamav3") is not None
    want = spec.backend
    if want == "auto":
        want = "exllamav3" if (hw.cuda and has_exl and not hw.zero_gpu and not spec.demo) else "torch"
    if want == "exllamav3" and hw.zero_gpu:
        notes.append("ZeroGPU cannot run exllamav3's CUDA extension (docs/app.md); using the torch backend.")
        want = "torch"
    elif want == "exllamav3" and not (hw.cuda and has_exl):
        why = "no CUDA GPU" if not hw.cuda else "exllamav3 is not installed"
        notes.append(f"exllamav3 backend asked for but {why}; using the torch backend on CPU instead.")
        want = "torch"
    device = spec.device or ("cuda" if want == "torch" and (hw.cuda or hw.zero_gpu) and not spec.demo else "cpu")
    return want, device, notes


def open_backend(name: str, target: str, draft: str | None, device: str, split: GpuSplit | None = None) -> Backend:
    """The named backend over local folders, built by the runtime's factory."""
    return load_backend(name, target, draft, device=device, split=split)


def say(line: str) -> None:
    """A console line for whoever started the app (before the page serves, logging is not configured yet)."""
    print(f"[app] {line}", file=sys.stderr, flush=True)


def prepare_demo(smollm2) -> tuple[Path, Path]:
    """The SmolLM2 pair; the first start converts the target (~60-90 s), so say so before and after."""
    first = smollm2.complete(smollm2.cache_root() / smollm2.TARGET_NAME) is None
    if first:
        say("first start: preparing the demo target SmolLM2-135M-Instruct (converting it once, ~60-90 s)…")
    t0 = time.perf_counter()
    pair = smollm2.default_pair()
    if first:
        say(f"demo target ready in {time.perf_counter() - t0:.0f} s ({pair[0]}); loading the models")
    return pair


def demo_pair(out: Loaded) -> tuple[str, str]:
    """The embedded pair: SmolLM2-135M-Instruct + its trained drafter, else (or with DFLASH_DEMO=tiny) the tiny pair."""
    from ..assets.pairs import tiny_pair

    if os.environ.get("DFLASH_DEMO", "smollm2").lower() != "tiny":
        try:
            from ..assets import smollm2

            t, d = prepare_demo(smollm2)
            out.demo_kind, out.target, out.draft = "smollm2", "SmolLM2-135M-Instruct (embedded demo)", "DFlash drafter trained for it (toolkit/data/smollm2_dflash)"
            return str(t), str(d)
        except ToolkitError as e:
            out.notes.append(f"The SmolLM2 demo pair is unavailable ({e}); running the tiny toy pair instead.")
    t, d = tiny_pair()
    out.demo_kind, out.target, out.draft = "tiny", "embedded tiny pair (toolkit/data/tiny_pair/target)", "tiny DFlash drafter, block 16"
    return str(t), str(d)


def load(spec: ModelSpec, hw: Hardware | None = None, opener: Callable = open_backend) -> Loaded:
    """Load the backend for `spec`; never raises (a failure becomes Loaded.error, shown in the page)."""
    hw = hw or Hardware.detect()
    name, device, notes = choose_backend(spec, hw)
    out = Loaded(None, demo=spec.demo, backend_name=name, device=device, notes=notes, hardware=hw)
    try:
        if spec.demo:
            target, draft = demo_pair(out)
        else:
            if spec.draft is None:
                raise ToolkitError("draft: no drafter given (--draft or DFLASH_DRAFT); the app compares speculative with AR")
            (target, out.target), (draft, out.draft) = fetch_model(spec.target, "target"), fetch_model(spec.draft, "draft")
        if not spec.split.default and name != "exllamav3":
            raise ToolkitError(f"the GPU split ({spec.split.tag}) needs the exllamav3 backend; this runs {name}"
                               + (f" ({notes[-1].rstrip('.')})" if notes else ""))
        try:
            out.backend = opener(name, target, draft, device, **({} if spec.split.default else {"split": spec.split}))
        except ToolkitError:
            raise
        except Exception as e:  # exllamav3's extension failed to build/load: try the torch backend once
            if name != "exllamav3":
                raise
            log.exception("exllamav3 backend failed")
            out.notes.append(f"exllamav3 failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                             "using the torch backend instead" + (", on one device." if not spec.split.default else "."))
            out.backend_name, out.device = "torch", "cuda" if hw.cuda else "cpu"
            out.backend = opener("torch", target, draft, out.device)
        out.backend.warm_up(out.backend.encode("Hello"))
    except ToolkitError as e:
        out.backend, out.error = None, f"Could not load the models: {e}"
    except Exception as e:  # OOM, a broken checkpoint, a CUDA error: the page says so and keeps serving
        log.exception("model load failed")
        out.backend, out.error = None, f"Could not load the models: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return out


def gpu_wrap(fn: Callable, hw: Hardware, duration: int = 120) -> Callable:
    """@spaces.GPU on ZeroGPU; everywhere else `fn` itself (no-op)."""
    if not hw.zero_gpu:
        return fn
    import spaces  # app.py imports it before torch on ZeroGPU

    return spaces.GPU(duration=duration)(fn)
