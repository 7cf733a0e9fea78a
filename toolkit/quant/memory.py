"""GPU memory of a quantize run: the plan's estimate per step, and the measured time and peak per step.

The steps are ordered so that the biggest thing on the GPU is the target alone, or the target with one
drafter. With an EXL3 target: the target runs once to make every prompt's continuation and taps and to hand
over its embedding table (kept on the CPU) and LM head (read through its kernel), then it is unloaded; calibration,
conversion and the KL check run beside the drafters only; for τ and speed the target is loaded again with one
drafter at a time; bitrates convert one after another (two at once take as long and twice the memory).
`plan_memory` estimates each step from the configs and the files' sizes (--dry-run prints it; the run refuses a
GPU whose free memory is below the peak before loading anything); `Meter` measures each step (and `Phases` parts
of one): torch's peak in this process, and the device's used memory sampled every 50 ms, which also sees the
converter subprocess and the CUDA context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..core.target import TargetInfo
from ..core.tensorfiles import index_size
from ..dflash import DFlashConfig
from .validate import expected_shapes, linear_keys

GIB = 1024**3
RESERVE = GIB                # CUDA context, kernel workspaces, allocator slack: never in torch's counters
CARD_24GB = 22 * GIB         # what a 24 GB card leaves to one process
PAGE = 256                   # exllamav3's cache page
BATCH = 8                    # prompts continued together on the EXL3 target
PROMPT_TOKENS = 512          # prompt length the plan assumes before the prompts are tokenized (dry run)


def pages(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


def job_tokens(max_prompt: int, max_new_tokens: int, block: int) -> int:
    """Cache positions one job takes in the exllamav3 backend (as Exl3Backend counts them), plus a page of slack."""
    return pages(max_prompt + max_new_tokens + block + 1) + PAGE


@dataclass
class Need:
    """One step's estimate: what is on the GPU, by name, in bytes (the reserve is added to the total)."""

    step: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values()) + RESERVE


@dataclass
class Sizes:
    """The inputs of the estimate. kind: exl3 | hf | none (no target: conversion only)."""

    kind: str
    config: DFlashConfig
    target_cfg: dict
    target_weights: int | None            # bytes the target's weights take on the GPU (None: unknown)
    max_prompt: int = PROMPT_TOKENS
    max_new_tokens: int = 64
    n_prompts: int = 1


def numel(config: DFlashConfig) -> int:
    n = 0
    for shape in expected_shapes(config).values():
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def hessian_bytes(config: DFlashConfig) -> int:
    """float32 in x in per Linear, as the calibration step accumulates them."""
    shapes = expected_shapes(config)
    return sum(4 * shapes[k + ".weight"][1] ** 2 for k in linear_keys(config))


def converter(config: DFlashConfig) -> dict[str, int]:
    """GPU bytes of the converter subprocess, by part: 2 GiB + two Hessians of the widest Linear as its working
    set fits the measured device peaks (Qwen3.6 drafter 9.46 GiB, SmolLM2 pair 4.24 GiB, with our context)."""
    shapes = expected_shapes(config)
    widest = max((4 * shapes[k + ".weight"][1] ** 2 for k in linear_keys(config)), default=0)
    return {"converter: drafter (bf16)": 2 * numel(config), "converter: Hessians": hessian_bytes(config),
            "converter: CUDA context": GIB, "converter: working set": 2 * GIB + 2 * widest}


def target_text(cfg: dict) -> dict:
    return TargetInfo(cfg).text


def exl3_weights(folder: Path, cfg: dict) -> int | None:
    """GPU bytes of an EXL3 target: its safetensors (or the index's total_size when the weights are not here)
    less the unquantized embedding table, which exllamav3 keeps on the CPU."""
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if not size:
        size = index_size(folder)
        if size is None:
            return None
    info = TargetInfo(cfg)
    return max(0, size - 2 * info.vocab_size * info.hidden_size)


def hf_weights(folder: Path, cfg: dict) -> int | None:
    """GPU bytes of a transformers target as quant.blocks.load_target loads it: bf16, float32 below 2B parameters
    (the size from the safetensors, or the index's total_size when the weights are not here)."""
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if not size:
        size = index_size(folder)
        if size is None:
            return None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or target_text(cfg).get("dtype") or "bfloat16")
    params = size // (4 if "32" in dtype else 2)
    return params * (4 if params < 2_000_000_000 else 2)


def cache(cfg: dict, tokens: int, slots: int) -> int:
    from ..exl3.backend import cache_bytes

    return cache_bytes(cfg, tokens, slots)


def plan_memory(sz: Sizes, calibrate: bool, convert: bool, check: bool) -> list[Need]:
    """Estimated GPU bytes of each step that uses the GPU, in run order."""
    c, info = sz.config, TargetInfo(sz.target_cfg or {})          # the target's numbers, each in its range
    vocab, hidden = info.vocab_size or c.vocab_size or 0, info.hidden_size or c.hidden_size
    d16, d32, hess = 2 * numel(c), 4 * numel(c), hessian_bytes(c)
    head = 2 * vocab * hidden
    weights = sz.target_weights or 0
    n = sz.max_prompt + sz.max_new_tokens
    out: list[Need] = []
    if sz.kind == "exl3" and (calibrate or check):
        batch = min(BATCH, max(1, sz.n_prompts))
        out.append(Need("target", {"target weights": weights,
                                   "target cache": cache(sz.target_cfg, batch * job_tokens(sz.max_prompt, sz.max_new_tokens, 1), batch),
                                   "logits and taps of one forward": n * (4 * vocab + 2 * hidden * len(c.target_layer_ids) * 2),
                                   "LM head read (128 rows at a time)": 2 * 128 * 4 * vocab}))
    resident = {"target weights": weights} if sz.kind == "hf" else {}
    if sz.kind == "hf":
        out.append(Need("target", {**resident, "logits and hidden states": n * (4 * vocab + 4 * hidden * (info.num_layers + 1))}))
    if calibrate and sz.kind != "none":
        out.append(Need("calibrate", {**resident, "reference drafter (fp32)": d32, "Hessians (fp32)": hess}))
    if convert:
        out.append(Need("convert", {**resident, **converter(c)}))
    if check and sz.kind != "none":
        out.append(Need("check", {**resident, "reference drafter (fp32)": d32, "quantized drafter (fp32)": d32,
                                  **({"LM head (fp16)": head} if sz.kind == "exl3" else {})}))
    if check and sz.kind == "exl3":
        tokens = job_tokens(sz.max_prompt, sz.max_new_tokens, c.block_size)
        out.append(Need("speed", {"target weights": weights, "target cache": cache(sz.target_cfg, tokens, 1),
                                  "drafter (bf16)": d16, "drafter cache": cache(c.to_dict(), tokens, 1)}))
    return out


def peak(needs: list[Need]) -> Need | None:
    return max(needs, key=lambda x: x.total, default=None)


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.1f} GiB"


def format_memory(needs: list[Need], weights_known: bool = True) -> str:
    """The plan's memory table for --dry-run, with the peak and whether it fits a 24 GB card."""
    if not needs:
        return "memory plan: nothing runs on the GPU but the converter"
    lines = ["memory plan (GPU, estimated; a reserve of 1.0 GiB for the CUDA context is in each total):"]
    for nd in needs:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in nd.parts.items())
        lines.append(f"  {nd.step:<10} {gib(nd.total):>9}  {parts}")
    top = peak(needs)
    if not weights_known:
        lines.append(f"  peak: {gib(top.total)} in step {top.step} without the target's weights, which are not here "
                     "and cannot be sized: whether it fits a 24 GB card is not known")
        return "\n".join(lines)
    fits = "fits" if top.total <= CARD_24GB else "does not fit"
    lines.append(f"  peak: {gib(top.total)} in step {top.step}: {fits} a 24 GB card (about {gib(CARD_24GB)} usable)")
    return "\n".join(lines)


class Meter:
    """Seconds and peak GPU memory of one step: torch's peak in this process, and the device's used memory
    (total - free) sampled every 50 ms, which also sees subprocesses."""

    def __init__(self, enabled: bool = True) -> None:
        import torch

        self.cuda = enabled and torch.cuda.is_available()
        self.seconds = 0.0
        self.peak_allocated: int | None = None
        self.peak_device: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        import torch

        while True:
            free, total = torch.cuda.mem_get_info()
            self.peak_device = max(self.peak_device or 0, total - free)
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> "Meter":
        import torch

        self.t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self.seconds = time.perf_counter() - self.t0
        if self.cuda:
            self._stop.set()
            self._thread.join()
            self.peak_allocated = int(torch.cuda.max_memory_allocated())

    def row(self, step: str, estimate: int | None) -> dict:
        return {"step": step, "seconds": round(self.seconds, 2), "peak_allocated_bytes": self.peak_allocated,
                "peak_device_bytes": self.peak_device, "estimated_bytes": estimate}


class Phases:
    """The phases of one step, each measured alone by a Meter (torch's peak reset at its start): rows of
    {"phase", "seconds", "peak_allocated_bytes", "peak_device_bytes"}, None memory without CUDA."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.rows: list[dict] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with Meter(self.enabled) as m:
            yield
        row = m.row(name, None)
        self.rows.append({"phase": name, **{k: row[k] for k in ("seconds", "peak_allocated_bytes",
                                                                 "peak_device_bytes")}})

    def fold(self, row: dict) -> dict:
        """The step's row with its phases; torch's step peak is the highest of its own and the phases' (each phase
        reset it)."""
        if not self.rows:
            return row
        peaks = [r["peak_allocated_bytes"] for r in [row, *self.rows] if r["peak_allocated_bytes"] is not None]
        return {**row, "peak_allocated_bytes": max(peaks, default=None), "phases": self.rows}


def summary(rows: list[dict], needs: list[Need]) -> dict:
    """report.json's `memory`: the measured peaks over all steps and the plan's estimated peak."""
    def top(key: str) -> int | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return max(vals) if vals else None

    p = peak(needs)
    return {"peak_allocated_bytes": top("peak_allocated_bytes"), "peak_device_bytes": top("peak_device_bytes"),
            "estimated_peak_bytes": p.total if p else None, "estimated_peak_step": p.step if p else None,
            "card_budget_bytes": CARD_24GB}
