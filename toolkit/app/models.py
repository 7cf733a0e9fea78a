"""Which backend and models the app runs: flags > env vars > the embedded demo pair; Space hardware aware.

Env vars: DFLASH_TARGET, DFLASH_DRAFT (local folders or Hub refs USER/NAME[@REVISION], e.g. a quant branch
@4.0bpw, fetched through core.refs), DFLASH_BACKEND (auto|torch|exllamav3), DFLASH_DEVICE, DFLASH_DEMO
(smollm2|tiny: which embedded pair runs when no models are given; smollm2 falls back to tiny when its target
cannot be prepared offline), and for the exllamav3 backend on several GPUs DFLASH_GPU_SPLIT (auto|GB,GB,...),
DFLASH_TENSOR_PARALLEL (1/0), DFLASH_DRAFT_DEVICE (N) (runtime/placement.py). On a Space, SPACE_ID and
ACCELERATOR ("none"/"cpu-basic" = CPU) pick the hardware. On a CUDA GPU with exllamav3 installed the SmolLM2 demo
runs there, its two models zero-padded once to exllamav3's 128-aligned widths (toolkit.assets.padding, the same
function); without exllamav3 it runs on the torch backend, on the GPU when there is one.
Loading never raises: a failure is kept as a message that the page shows. The console names each step of the
start (prepare, load, calibrate, warm-up) with its time.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..core.errors import ToolkitError
from ..core.refs import fetch, parse_ref
from ..mtp import is_mtp
from ..runtime.backend import Backend, Capabilities, GenSettings
from ..runtime.factory import load_backend
from ..runtime.registry import BACKENDS as REGISTRY, backend_class, capabilities, cpu_backend, gpu_backend
from ..runtime.placement import ENV, GpuSplit, from_env
from .policy_view import PolicyStart

log = logging.getLogger("toolkit.app")
BACKENDS = ("auto", *REGISTRY)


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
    steps: dict[str, float] = field(default_factory=dict)   # start-up step -> seconds, in order
    policy_start: PolicyStart | None = None          # the auto policies after the start-up: every turn starts there

    @property
    def lockstep(self) -> bool:
        """Whether a turn decodes its two runs in lockstep: on a CPU, where load moves a run's speed more than
        drafting does (on a GPU they run one after the other)."""
        return self.backend is not None and self.device == "cpu"

    @property
    def engine(self) -> str:
        """The backend in words, for the page title: ExLlamaV3 on a GPU, PyTorch on the CPU or a GPU."""
        caps = self.caps
        if caps.gpu_only:
            return f"{caps.engine} (GPU)"
        return f"{caps.engine} (CPU)" if self.device == "cpu" else f"{caps.engine} ({self.device.split(':')[0].upper()})"

    @property
    def caps(self) -> Capabilities:
        """What the chosen backend can do (a name the registry does not know: the CPU backend's)."""
        return capabilities(self.backend_name if self.backend_name in REGISTRY else cpu_backend())

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
    gpu, cpu = gpu_backend(), cpu_backend()
    ready = backend_class(gpu).installed()
    want = spec.backend
    if want == "auto":
        want = gpu if (hw.cuda and ready and not hw.zero_gpu) else cpu
    if capabilities(want).gpu_only and hw.zero_gpu:
        notes.append(f"ZeroGPU cannot run {want}'s CUDA extension (docs/app.md); using the {cpu} backend.")
        want = cpu
    elif capabilities(want).gpu_only and not (hw.cuda and backend_class(want).installed()):
        why = "no CUDA GPU" if not hw.cuda else f"{want} is not installed"
        notes.append(f"{want} backend asked for but {why}; using the {cpu} backend on CPU instead.")
        want = cpu
    device = spec.device or ("cuda" if capabilities(want).gpu_only or hw.cuda or hw.zero_gpu else "cpu")
    return want, device, notes


def open_backend(name: str, target: str, draft: str | None, device: str, split: GpuSplit | None = None) -> Backend:
    """The named backend over local folders, built by the runtime's factory."""
    return load_backend(name, target, draft, device=device, split=split)


def say(line: str) -> None:
    """A console line for whoever started the app (before the page serves, logging is not configured yet)."""
    print(f"[app] {line}", file=sys.stderr, flush=True)


@contextmanager
def step(out: "Loaded", name: str, what: str | Callable[[], str]) -> Iterator[None]:
    """Time one start-up step into out.steps and name it on the console when it ends (`what` may be a function,
    called then)."""
    t0 = time.perf_counter()
    yield
    out.steps[name] = time.perf_counter() - t0
    say(f"{name}: {what() if callable(what) else what} ({out.steps[name]:.1f} s)")


def prepare_demo(smollm2) -> tuple[Path, Path]:
    """The SmolLM2 pair; the first start converts the target once (reading the GGUF takes most of it), so say so."""
    if smollm2.complete(smollm2.cache_root() / smollm2.TARGET_NAME) is None:
        say("prepare: first start, converting the demo target SmolLM2-135M-Instruct from its GGUF once…")
    return smollm2.default_pair()


def padded_pair(target: str, draft: str) -> tuple[str, str]:
    """The demo pair zero-padded to 128-aligned widths for exllamav3 (same outputs), made once next to the target."""
    from ..assets.padding import pad

    out = []
    for src, name in ((target, "target"), (draft, "draft")):
        dst = Path(target).parent / f"{Path(target).name}-exllamav3" / name
        if not (dst / "config.json").is_file():
            pad(src, str(dst), force=dst.exists())
        out.append(str(dst))
    return out[0], out[1]


def demo_pair(out: Loaded) -> tuple[str, str]:
    """The embedded pair: SmolLM2-135M-Instruct + its trained drafter, else (or with DFLASH_DEMO=tiny) the tiny pair.
    On exllamav3 the SmolLM2 pair is padded for it; the tiny pair runs on the torch backend."""
    t, d = pick_demo(out)
    if out.caps.width_multiple == 1:
        return t, d
    if out.demo_kind == "smollm2":
        return padded_pair(t, d)
    out.notes.append("The tiny toy pair runs on the torch backend (exllamav3 needs 128-aligned widths).")
    out.backend_name, out.device = "torch", "cuda" if out.hardware.cuda else "cpu"
    return t, d


def pick_demo(out: Loaded) -> tuple[str, str]:
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
        with step(out, "prepare", "the models' folders are ready"):
            target, draft = models_of(spec, out)
        name = out.backend_name
        if not spec.split.default and not capabilities(name).placement:
            raise ToolkitError(f"the GPU split ({spec.split.tag}) needs the exllamav3 backend; this runs {name}"
                               + (f" ({notes[-1].rstrip('.')})" if notes else ""))
        with step(out, "load", f"{name} backend on {out.device}"):
            open_models(out, spec, hw, opener, target, draft)
        with step(out, "calibrate", lambda: "the auto policy's round cost of each verify width: "
                                            + (out.backend.cost_source() or "none needed")):
            out.backend.prepare(GenSettings())
        with step(out, "warm-up", "a short speculative and a plain decode"):
            out.backend.warm_up(out.backend.encode("Hello"))
        out.policy_start = PolicyStart(out.backend)
    except ToolkitError as e:
        out.backend, out.error = None, f"Could not load the models: {e}"
    except Exception as e:  # OOM, a broken checkpoint, a CUDA error: the page says so and keeps serving
        log.exception("model load failed")
        out.backend, out.error = None, f"Could not load the models: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return out


def models_of(spec: ModelSpec, out: Loaded) -> tuple[str, str]:
    """Local folders of the target and the drafter: the demo pair, or the given folders / Hub refs fetched."""
    if spec.demo:
        return demo_pair(out)
    if spec.draft is None:
        raise ToolkitError("draft: no drafter given (--draft or DFLASH_DRAFT); the app compares speculative with AR")
    target, out.target = fetch_model(spec.target, "target")
    if is_mtp(spec.draft):                       # the target's own MTP head: nothing to fetch
        out.draft = "the target's own MTP head"
        return target, spec.draft
    draft, out.draft = fetch_model(spec.draft, "draft")
    return target, draft


def open_models(out: Loaded, spec: ModelSpec, hw: Hardware, opener: Callable, target: str, draft: str) -> None:
    """out.backend over the folders; when exllamav3's extension fails to build or load, the torch backend once."""
    name = out.backend_name
    try:
        out.backend = opener(name, target, draft, out.device, **({} if spec.split.default else {"split": spec.split}))
    except ToolkitError:
        raise
    except Exception as e:
        if not capabilities(name).gpu_only:
            raise
        log.exception("exllamav3 backend failed")
        out.notes.append(f"exllamav3 failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                         "using the torch backend instead" + (", on one device." if not spec.split.default else "."))
        out.backend_name, out.device = "torch", "cuda" if hw.cuda else "cpu"
        out.backend = opener("torch", target, draft, out.device)


def gpu_wrap(fn: Callable, hw: Hardware, duration: int = 120) -> Callable:
    """@spaces.GPU on ZeroGPU; everywhere else `fn` itself (no-op)."""
    if not hw.zero_gpu:
        return fn
    import spaces  # app.py imports it before torch on ZeroGPU

    return spaces.GPU(duration=duration)(fn)
