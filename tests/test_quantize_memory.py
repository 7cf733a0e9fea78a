"""The quantize pipeline's GPU memory: the plan of the real Qwen3.6-35B-A3B shape against a 24 GB card, the
converter's estimate against its measured peak, an EXL3 target's weight bytes, and each step's phases measured
apart (CUDA's counters faked)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from toolkit.dflash import DFlashConfig
from toolkit.quant import memory as mem

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "quantize" / "shapes"
GIB = 1024**3


def real_shape_sizes(weights: int) -> mem.Sizes:
    draft = json.loads((SHAPES / "qwen3.6-35b-a3b-dflash.json").read_text())
    target = json.loads((SHAPES / "qwen3.6-35b-a3b.json").read_text())
    return mem.Sizes("exl3", DFlashConfig.from_dict(draft), target, weights, mem.PROMPT_TOKENS, 128, 18)


def test_memory_plan_of_the_real_shape_fits_a_24gb_card():
    """Qwen3.6-35B-A3B at 4.0 bpw (about 18.5 GB of files, the embedding table on the CPU) with its drafter."""
    target = json.loads((SHAPES / "qwen3.6-35b-a3b.json").read_text())
    folder_bytes = 18_500_000_000
    weights = folder_bytes - 2 * 248320 * 2048
    needs = mem.plan_memory(real_shape_sizes(weights), calibrate=True, convert=True, check=True)
    assert [n.step for n in needs] == ["target", "calibrate", "convert", "check", "speed"]
    top = mem.peak(needs)
    assert top.total <= 22 * GIB and top.step in ("target", "speed")
    # the target is on the GPU only while it makes the prompts and while it verifies drafts
    assert [n.step for n in needs if "target weights" in n.parts] == ["target", "speed"]
    by = {n.step: n for n in needs}
    assert by["calibrate"].total < 8 * GIB and by["check"].total < 8 * GIB
    assert by["speed"].parts["drafter (bf16)"] == 2 * mem.numel(real_shape_sizes(weights).config)
    assert mem.cache(target, 1024, 1) > 0
    text = mem.format_memory(needs)
    assert f"peak: {top.total / GIB:.1f} GiB in step {top.step}: fits a 24 GB card" in text
    # a 8.0 bpw target (about 36 GB) would not
    big = mem.plan_memory(real_shape_sizes(2 * weights), calibrate=True, convert=True, check=True)
    assert "does not fit a 24 GB card" in mem.format_memory(big)


def test_the_converter_estimate_matches_the_measured_peaks():
    """One converter beside this process: 9.46 GiB device peak for the Qwen3.6 drafter on the H200 (2026-12-03)."""
    sz = real_shape_sizes(17 * GIB)
    conv = next(n for n in mem.plan_memory(sz, calibrate=True, convert=True, check=True) if n.step == "convert")
    assert abs(conv.total / GIB - 9.46) < 0.1 and conv.parts == {**mem.converter(sz.config)}


def test_exl3_weights_from_files_or_index(tmp_path):
    cfg = {"vocab_size": 10, "hidden_size": 4}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1000}}))
    assert mem.exl3_weights(tmp_path, cfg) == 1000 - 80
    (tmp_path / "a.safetensors").write_bytes(b"\0" * 500)
    assert mem.exl3_weights(tmp_path, cfg) == 500 - 80
    (tmp_path / "none").mkdir()
    assert mem.exl3_weights(tmp_path / "none", cfg) is None


def test_phases_measure_each_part_of_a_step_and_keep_its_peak(monkeypatch):
    """CUDA's counters faked: each phase gets torch's peak and the device's used memory within it alone; the step's
    torch peak stays the highest (each phase reset torch's counter, so the step's own reading alone would be low)."""
    state = {"allocated": 0, "peak": 0, "used": 0}

    def alloc(n: int) -> None:
        state["allocated"] += n
        state["peak"] = max(state["peak"], state["allocated"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (80 * GIB - state["used"], 80 * GIB))
    phases = mem.Phases()
    with mem.Meter() as step:
        with phases.phase("load"):
            alloc(15 * GIB)                      # the load's measuring forward, then freed
            state["used"] = 17 * GIB
            time.sleep(0.15)
            alloc(-5 * GIB)
            state["used"] = 12 * GIB             # given back to the device as the load ends
        with phases.phase("forward"):
            alloc(2 * GIB)
            alloc(-2 * GIB)
            state["used"] = 14 * GIB
            time.sleep(0.15)
    row = phases.fold(step.row("target", 20 * GIB))
    assert step.peak_allocated == 12 * GIB                           # since the last reset only
    assert [(p["phase"], p["peak_allocated_bytes"], p["peak_device_bytes"]) for p in row["phases"]] == [
        ("load", 15 * GIB, 17 * GIB), ("forward", 12 * GIB, 14 * GIB)]
    assert row["peak_allocated_bytes"] == 15 * GIB and row["peak_device_bytes"] == 17 * GIB
    assert row["estimated_bytes"] == 20 * GIB and all(p["seconds"] >= 0.15 for p in row["phases"])
    plain = {"step": "plan", "peak_allocated_bytes": None}
    assert mem.Phases().fold(plain) == plain                         # a step without phases: its row as it was
