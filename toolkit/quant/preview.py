"""A quantize run on the CPU, before any GPU: the pipeline as it is, with a stand-in for exllamav3's converter.

exllamav3's converter needs a CUDA GPU. The stand-in takes the converter's arguments and writes what it writes (a
config.json with the DFlash keys and a quantization_config, safetensors with every norm kept), with each Linear
rounded to a plain grid of 2^bits levels per row and stored in fp16: real quantization error for the check to
measure, but not EXL3. Each folder's quantization_config says so (`preview`), and push refuses such a run except
as a dry run. The recipe of the tiny pair (its prompts are Python stdlib names, as it was trained on) is written
to a temporary file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREVIEW = ("a CPU preview made by python -m toolkit.preview_run: each Linear rounded to a plain grid of 2^bits levels "
           "and stored in fp16, not EXL3; for trying the card and push --dry-run only")
TINY_CAL = ["json.dumps", "textwrap.wrap", "shutil.copy", "random.choice", "os.path.join", "re.sub"]
TINY_CHECK = ["pathlib.Path", "argparse.ArgumentParser", "csv.reader", "itertools.chain"]


def stand_in(args: list[str], log_path: Path) -> int:
    """convert_model's arguments -> a folder of rounded fp16 Linears (see the module docstring); exit status 0."""
    import torch

    from ..core.tensorfiles import iter_tensors, save_tensors

    ap = argparse.ArgumentParser()
    for short, long in (("-i", "--in_dir"), ("-o", "--out_dir"), ("-w", "--work_dir"), ("-b", "--bits"),
                        ("-d", "--devices"), ("-hess", "--hessians"), ("-rcp", "--recipe")):
        ap.add_argument(short, long, default=None)
    a = ap.parse_args(args)
    src, out, bits = Path(a.in_dir), Path(a.out_dir), float(a.bits)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"stand-in converter (CPU preview): {bits} bits, Linears rounded to a plain grid\n")
    out.mkdir(parents=True, exist_ok=True)
    levels = 2 ** (bits - 1)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in iter_tensors(f, "--in_dir"):
            w = v.float()
            if k.endswith("_proj.weight") or k == "fc.weight":          # the drafter's Linears
                scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / levels
                w = (w / scale).round().clamp(-levels, levels) * scale
            tensors[k] = w.to(torch.float16).contiguous()
    save_tensors(tensors, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "bits": bits, "preview": PREVIEW}
    (out / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    return 0


@contextmanager
def cpu_converter() -> Iterator[None]:
    """The stand-in in place of exllamav3's converter (convert.run_converter, the pipeline's one seam to it)."""
    from . import convert

    saved = convert.run_converter, convert.converter_unavailable
    convert.run_converter, convert.converter_unavailable = stand_in, lambda: None
    try:
        yield
    finally:
        convert.run_converter, convert.converter_unavailable = saved


@contextmanager
def tiny_recipe(target: Path) -> Iterator[Path]:
    """A recipe for the shipped tiny pair, in a temporary file removed afterwards."""
    text = (f'[model]\nid = "tiny-dflash"\n[target]\nid = "{target.name}"\n[bits]\ndefault = [3.0, 4.0]\n'
            f'[calibration]\nanchors_per_prompt = 4\nprompts = {json.dumps(TINY_CAL)}\n'
            f'[check]\nmax_new_tokens = 32\ntap_shift_candidates = [0, 1]\nprompts = {json.dumps(TINY_CHECK)}\n'
            '[thresholds]\ndefault = { min_top1 = 0.80, max_kl = 0.50, min_tau_ratio = 0.85 }\n')
    with tempfile.TemporaryDirectory(prefix="dflash-preview-") as tmp:
        path = Path(tmp) / "tiny-pair.toml"
        path.write_text(text)
        yield path
