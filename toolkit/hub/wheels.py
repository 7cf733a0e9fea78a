"""The prebuilt exllamav3 wheel a GPU Space installs, so that it never needs nvcc to JIT-compile the extension.

exllamav3 publishes one wheel per CUDA, torch and Python on its GitHub releases, named
`exllamav3-<version>+cu<cuda>.torch<torch>-cp<py>-cp<py>-linux_x86_64.whl`. BUILDS below is the matrix of its
release workflow (.github/workflows/build.yml, read from the exllamav3 repository): CUDA 12.8 for torch 2.7-2.11
on Python 3.10-3.14 (no torch 2.11 on 3.10/3.11, no torch 2.7/2.8 on 3.14), CUDA 13.2 for torch 2.11 on Python
3.12+; kernels for sm_80, 86, 89, 90, 100 and 120. `pick_wheel` refuses in one line what that matrix lacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ToolkitError
from ..exl3.seams import TESTED

EXLLAMAV3_VERSION = TESTED     # a Space installs the exllamav3 the toolkit is tested with (inside the gpu extra's range)
RELEASES = "https://github.com/turboderp-org/exllamav3/releases/download"
PYTORCH_INDEX = "https://download.pytorch.org/whl"
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
TORCHES = ("2.7.0", "2.8.0", "2.9.0", "2.10.0", "2.11.0")
TORCH_BUILD = {"12.8": "cu128", "13.2": "cu130"}    # the PyTorch build each wheel's torch comes from
WHEEL_ARCHS = (80, 86, 89, 90, 100, 120)            # compute capabilities the wheels carry kernels for
# The GPU of each Space hardware choice and its compute capability.
GPUS = {"t4": ("Tesla T4", 75), "l4": ("NVIDIA L4", 89), "a10g": ("NVIDIA A10G", 86), "a100": ("NVIDIA A100", 80),
        "h100": ("NVIDIA H100", 90)}


def builds() -> set[tuple[str, str, str]]:
    """(cuda, torch, python) of every wheel the release workflow builds."""
    out = set()
    for py in PYTHONS:
        for torch in TORCHES:
            if (torch == "2.11.0" and py in ("3.10", "3.11")) or (py == "3.14" and torch in ("2.7.0", "2.8.0")):
                continue
            out.add(("12.8", torch, py))
        if py not in ("3.10", "3.11"):
            out.add(("13.2", "2.11.0", py))
    return out


BUILDS = frozenset(builds())


@dataclass(frozen=True)
class Wheel:
    cuda: str
    torch: str
    python: str
    version: str = EXLLAMAV3_VERSION

    @property
    def filename(self) -> str:
        py = "cp" + self.python.replace(".", "")
        return f"exllamav3-{self.version}+cu{self.cuda.replace('.', '')}.torch{self.torch}-{py}-{py}-linux_x86_64.whl"

    @property
    def url(self) -> str:
        return f"{RELEASES}/v{self.version}/{self.filename}"

    @property
    def torch_pin(self) -> str:
        """torch, pinned to the build the wheel was compiled against."""
        return f"torch=={self.torch}+{TORCH_BUILD[self.cuda]}"

    @property
    def torch_index(self) -> str:
        return f"{PYTORCH_INDEX}/{TORCH_BUILD[self.cuda]}"


def gpu_of(hardware: str) -> tuple[str, int] | None:
    """(GPU name, compute capability) of a Space hardware choice; None for CPU and unknown names."""
    return next((gpu for prefix, gpu in GPUS.items() if hardware.startswith(prefix)), None)


def pick_wheel(hardware: str, python: str, torch: str, cuda: str) -> Wheel:
    """The wheel for this Space, or one ToolkitError line naming what no released wheel has."""
    gpu = gpu_of(hardware)
    if gpu and gpu[1] < min(WHEEL_ARCHS):
        raise ToolkitError(f"no prebuilt exllamav3 {EXLLAMAV3_VERSION} wheel runs on {hardware}: its {gpu[0]} is "
                           f"sm_{gpu[1]} and the wheels carry kernels for sm_{min(WHEEL_ARCHS)} and newer (pick "
                           "l4x1, a10g-*, a100-large or h100, --backend torch, or --exllamav3-jit to compile on the Space)")
    if (cuda, torch, python) in BUILDS:
        return Wheel(cuda, torch, python)
    if cuda not in TORCH_BUILD:
        missing = f"CUDA {cuda} (wheels exist for CUDA {', '.join(sorted(TORCH_BUILD))})"
    elif python not in PYTHONS:
        missing = f"Python {python} (wheels exist for Python {', '.join(PYTHONS)})"
    else:
        pys = sorted({p for c, t, p in BUILDS if (c, t) == (cuda, torch)}, key=PYTHONS.index)
        torches = sorted({t for c, t, p in BUILDS if (c, p) == (cuda, python)}, key=TORCHES.index)
        have = ([f"torch {torch} has them for Python {', '.join(pys)}"] if pys else []) + \
               ([f"Python {python} has them for torch {', '.join(torches)}"] if torches else [])
        missing = f"torch {torch} + CUDA {cuda} on Python {python}" + (f" ({'; '.join(have)})" if have else "")
    raise ToolkitError(f"no prebuilt exllamav3 {EXLLAMAV3_VERSION} wheel for {missing}; pick another --python/"
                       "--torch/--cuda, or pass --exllamav3-jit to compile it on the Space (needs nvcc)")
