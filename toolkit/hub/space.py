"""`python -m toolkit.space export DIR`: write a ready-to-push Hugging Face Space folder for the app.

The folder holds app.py, the toolkit package (with the embedded demo pair), requirements.txt for the chosen
hardware, README.md with the Space front matter, and space.json with the models the app loads by default.
Push it with `hf upload <user>/<space> DIR . --repo-type space` (see docs/space.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.folders import atomic_dir, check_out

ROOT = Path(__file__).resolve().parents[2]
GRADIO_VERSION = "6.31.0"      # the sdk_version written when gradio is not installed here
PYTHON_VERSION = "3.11"
# Keep in step with pyproject.toml [project] dependencies and the gpu extra (tests/test_space.py checks).
BASE_REQUIREMENTS = ["torch>=2.6", "transformers>=5.0,<6", "safetensors>=0.4", "huggingface-hub>=1.0,<3", "accelerate>=1.0",
                     "tokenizers>=0.21", "tqdm>=4.60", "numpy>=1.26", "matplotlib>=3.8"]
GPU_REQUIREMENTS = ["exllamav3==1.6.5"]
DEMO_REQUIREMENTS = ["gguf>=0.10"]                       # converts the SmolLM2 demo target when no models are given
HARDWARE = ("cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "a10g-small", "a10g-large",
            "a10g-largex2", "a10g-largex4", "a100-large", "h100", "zero-a10g")
GITATTRIBUTES = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.png filter=lfs diff=lfs merge=lfs -text\n"


def requirements(hardware: str) -> list[str]:
    """What the Space installs: the app's dependencies, plus exllamav3 on GPU hardware, plus spaces on ZeroGPU."""
    if hardware.startswith("cpu"):
        return BASE_REQUIREMENTS + DEMO_REQUIREMENTS
    if hardware.startswith("zero"):
        return BASE_REQUIREMENTS + DEMO_REQUIREMENTS + ["spaces"]   # ZeroGPU runs the torch backend (docs/space.md says why)
    return BASE_REQUIREMENTS + GPU_REQUIREMENTS + DEMO_REQUIREMENTS


def sdk_version() -> str:
    try:
        import gradio

        return gradio.__version__
    except ImportError:
        return GRADIO_VERSION


def front_matter(hardware: str = "l4x1", target: str | None = None, draft: str | None = None,
                 title: str = "DFlash speculative decoding") -> str:
    """The README.md front matter block a Space needs."""
    lines = ["---", f"title: {title}", "emoji: ⚡", "colorFrom: green", "colorTo: indigo", "sdk: gradio",
             f"sdk_version: {sdk_version()}", f'python_version: "{PYTHON_VERSION}"', "app_file: app.py",
             f"suggested_hardware: {hardware}"]
    models = [m for m in (target, draft) if m and not Path(m).exists()]   # Hub ids only
    if models:
        lines += ["models:"] + [f"  - {m}" for m in models]
    lines += ["short_description: DFlash speculative decoding vs plain AR, live", "license: apache-2.0",
              "pinned: false", "---"]
    return "\n".join(lines) + "\n"


def readme(hardware: str, target: str | None, draft: str | None, title: str) -> str:
    what = (f"Target `{target}` with DFlash drafter `{draft}`." if target else
            "No models configured: the app serves its embedded demo on tiny models (CPU).")
    return front_matter(hardware, target, draft, title) + f"""
# {title}

A chat that answers with DFlash speculative decoding on ExLlamaV3, next to plain autoregressive decoding on the
same target, with the measured speedup, tokens coloured by origin and live acceptance plots.

{what} Change the models in `space.json` or with the Space variables `DFLASH_TARGET` / `DFLASH_DRAFT`.
Built by `python -m toolkit.space export` from the dflash-exl3-toolkit repository (docs/space.md).
"""


def copy_package(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".tiny_pair.*")
    shutil.copytree(ROOT / "toolkit", dst / "toolkit", ignore=ignore)
    shutil.copy(ROOT / "app.py", dst / "app.py")


def export(dir: str, target: str | None = None, draft: str | None = None, hardware: str = "l4x1",
           backend: str = "auto", title: str = "DFlash speculative decoding", force: bool = False) -> Path:
    """Write the Space folder `dir` (via a temp folder renamed at the end: never half-written)."""
    if hardware not in HARDWARE:
        raise ToolkitError(f"hardware must be one of {', '.join(HARDWARE)}, got {hardware!r}")
    if (target is None) != (draft is None):
        raise ToolkitError("target/draft: give both (a Space compares the drafter's speculative output with the target's AR) or neither")
    if backend not in ("auto", "torch", "exllamav3"):
        raise ToolkitError(f"backend must be auto, torch or exllamav3, got {backend!r}")
    out = Path(dir)
    check_out(out, "dir: ", force, "--force")
    with atomic_dir(out) as tmp:
        copy_package(tmp)
        (tmp / "requirements.txt").write_text("\n".join(requirements(hardware)) + "\n")
        (tmp / "README.md").write_text(readme(hardware, target, draft, title))
        (tmp / "space.json").write_text(json.dumps({"target": target, "draft": draft, "backend": backend}, indent=2) + "\n")
        (tmp / ".gitattributes").write_text(GITATTRIBUTES)
    print(f"wrote {out} ({sum(1 for p in out.rglob('*') if p.is_file())} files); push with: "
          f"hf upload <user>/<space> {out} . --repo-type space")
    return out
