"""`python -m toolkit.space export DIR`: write a ready-to-push Hugging Face Space folder running the chat app."""

from __future__ import annotations

from dataclasses import dataclass

from .core.cli import entry, option, run_sub
from .hub.space import CUDA_VERSION, HARDWARE, PYTHON_VERSION, TORCH_VERSION, __doc__ as DOC, export


@dataclass
class ExportOptions:
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


def main(argv: list[str] | None = None):
    return run_sub({"export": (export, ExportOptions, "write a ready-to-push Space folder")}, argv,
                   "python -m toolkit.space", DOC.split("\n\n")[0], output_policy=True)


if __name__ == "__main__":
    entry(lambda argv: main(argv) and 0)
