"""The one seam between the quantize pipeline and exllamav3 at run time (the converter subprocess aside).

With an EXL3 target the pipeline asks five things of exllamav3: can it run here, how much GPU memory is free,
the target alone (greedy continuations and taps, runtime/exl3_taps.py), the target with one drafter (the
exllamav3 backend, for τ and speed), and another drafter in that loaded backend (runtime/exl3_swap.py).
`ENGINE` answers them; the CPU tests replace it with a stand-in over a transformers model, as they replace the
converter at convert.run_converter.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError


class Exl3Engine:
    """exllamav3 1.6.5 on the local CUDA GPU."""

    def unavailable(self, target: str) -> str | None:
        """Why an EXL3 target cannot run here (no CUDA GPU, one older than Ampere, exllamav3 missing or not 1.6.5),
        or None."""
        import torch

        if not torch.cuda.is_available():
            return (f"--target: {target} is an EXL3 model, and running it needs a CUDA GPU (none found on this machine); "
                    "pass a BF16 target, or --no-calibrate --no-check")
        from ..exl3.loading import MIN_CAPABILITY
        from ..exl3.taps import check_installed

        cap = tuple(torch.cuda.get_device_capability())
        if cap < MIN_CAPABILITY:
            return (f"--target: {target} is an EXL3 model, and exllamav3 needs compute capability "
                    f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; {torch.cuda.get_device_name()} has "
                    f"{cap[0]}.{cap[1]}")
        try:
            check_installed()
        except ToolkitError as e:
            return f"--target: {target} is an EXL3 model: {e}"
        return None

    def free_bytes(self, split=None) -> int:
        """Free bytes of GPU 0, or (a runtime.placement.GpuSplit) summed over the GPUs the split uses (the backend
        checks each device on its own before it loads)."""
        import torch

        if split is None or split.default:
            return int(torch.cuda.mem_get_info()[0])
        split.check_devices(torch.cuda.device_count())
        devices = set(split.devices(torch.cuda.device_count())) | {split.draft_device}
        return sum(int(torch.cuda.mem_get_info(i)[0]) for i in devices)

    def open_target(self, folder: Path, cache_tokens: int, max_concurrency: int, split=None,
                    max_chunk: int | None = None):
        """The target alone: runtime.exl3_taps.Exl3Target (continue_greedy, forward, embedding_table,
        head_weight, close); `split` places it across GPUs (None: GPU 0); `max_chunk` bounds its forwards."""
        from ..exl3.taps import open_target

        return open_target(folder, cache_tokens, max_concurrency, split=split, max_chunk=max_chunk)

    def open_backend(self, target: Path, draft: Path, cache_tokens: int, max_concurrency: int, split=None):
        """The target with one DFlash drafter on the exllamav3 backend (runtime.backend.Backend), placed by `split`."""
        from ..runtime.factory import load_backend

        return load_backend("exllamav3", target, draft, cache_tokens=cache_tokens, max_concurrency=max_concurrency,
                            split=split)

    def swap_draft(self, backend, draft: Path) -> None:
        """Another drafter in a backend from open_backend: the target stays loaded (runtime.exl3_swap)."""
        from ..exl3.swap import swap_draft

        swap_draft(backend, draft)


ENGINE = Exl3Engine()
