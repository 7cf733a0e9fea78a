"""A stand-in for exllamav3's convert_model, patched in at toolkit.quant.convert.run_converter only.

It parses the same arguments, writes what compile_model writes (config.json + quantization_config, safetensors
with every norm kept) and rounds each Linear to `bits` (per-row uniform grid) so the check has real error to
measure. Its Linears are stored as 16-bit `.weight`, which the check loads without exllamav3.
"""

from __future__ import annotations

import argparse
import errno
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CALLS: list[dict] = []


def parse(args: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    for short, long in (("-i", "--in_dir"), ("-o", "--out_dir"), ("-w", "--work_dir"), ("-b", "--bits"),
                        ("-d", "--devices"), ("-hess", "--hessians"), ("-rcp", "--recipe")):
        ap.add_argument(short, long, default=None)
    return ap.parse_args(args)


def round_to_bits(w: torch.Tensor, bits: float) -> torch.Tensor:
    levels = 2 ** (max(bits, 1.0) - 1)
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / levels
    return (w / scale).round().clamp(-levels, levels) * scale


def convert(args: list[str], log_path: Path, mode: str = "ok") -> int:
    """mode: ok | crash (half-written output, exit -11) | disk (ENOSPC) | refuse (prints an error, exit 0)."""
    a = parse(args)
    CALLS.append({"bits": float(a.bits), "hessians": a.hessians, "recipe": a.recipe, "out": a.out_dir})
    log_path.write_text(f" -- Creating new job\n    Target bitrate: {a.bits}\n")
    out, src = Path(a.out_dir), Path(a.in_dir)
    if mode == "refuse":
        log_path.write_text(" !! Error: --bits must be between 1 and 8\n")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if a.hessians:
        for f in Path(a.hessians).glob("*.safetensors"):
            assert "hin" in load_file(f), f
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    q = {}
    for k, v in tensors.items():
        is_linear = k.endswith("_proj.weight") or k == "fc.weight"
        q[k] = (round_to_bits(v.float(), float(a.bits)) if is_linear else v.float()).half().contiguous()
    if mode == "crash":
        (out / "model.safetensors").write_bytes(b"\x00" * 64)
        log_path.write_text("Segmentation fault (core dumped)\n")
        return -11
    if mode == "disk":
        (out / "model.safetensors").write_bytes(b"\x00" * 64)
        log_path.write_text(f"OSError: [Errno {errno.ENOSPC}] No space left on device\n")
        return 1
    save_file(q, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "version": "1.6.5", "bits": float(a.bits), "head_bits": 6,
                                  "out_scales": "auto", "codebook": "mul1"}
    (out / "config.json").write_text(json.dumps(cfg, indent=4))
    (out / "quantization_config.json").write_text(json.dumps(cfg["quantization_config"]))
    return 0


def install(monkeypatch, modes: dict[float, str] | None = None) -> list[dict]:
    """Patch the converter boundary (and the GPU probe); modes maps bits -> failure mode."""
    from toolkit.quant import convert as conv

    CALLS.clear()

    def fake(args, log_path):
        bits = float(args[args.index("-b") + 1])
        return convert(args, log_path, (modes or {}).get(bits, "ok"))

    monkeypatch.setattr(conv, "run_converter", fake)
    monkeypatch.setattr(conv, "converter_unavailable", lambda: None)
    return CALLS
