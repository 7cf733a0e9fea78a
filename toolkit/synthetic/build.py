"""synth(): write a synthetic EXL3 checkpoint of a config's exact shape (random trellis, realistic scales)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from ..core.folders import atomic_dir
from .codebook import codebook_table, decode_linear
from .inputs import SynthInputs, check_inputs
from .layout import Plan, TensorSpec, build_plan
from .tokenizer import write_tokenizer
from .writer import SMALL, Staging, check_space, human, plan_shards, shard_names, write_index, write_shard

EXL3_VERSION = "1.6.5"
CHECKED_LINEARS = 3          # linears whose leading 128x128 block is decoded back as a check
# `--routing skewed`: each router row scaled by exp(ROUTER_SKEW * z), z ~ N(0, 1) per expert, so some experts win
# more often; with 256 experts and top-8, windows of 8 and 15 tokens then touch about 40 and 58 distinct experts
# (random: 57 and 97), near the counts published for real routing (39.4 and 58.9)
ROUTER_SKEW = 0.7
CHECK_TOL = 0.15             # decoded std must be within 15% of the requested std


class Filler:
    """Makes each planned tensor: big ones with one random call on the device, small ones on the host."""

    def __init__(self, device: str, seed: int, codebook: str):
        self.device = device
        self.gens = {d: torch.Generator(device=d).manual_seed(seed + i) for i, d in enumerate(dict.fromkeys(["cpu", device]))}
        self.cb_std = float(codebook_table(codebook).double().std())

    def __call__(self, t: TensorSpec) -> torch.Tensor:
        dev = "cpu" if t.nbytes < SMALL else self.device
        g = self.gens[dev]
        if t.fill == "trellis":                     # uniform random bits: every trellis state equally likely
            return torch.randint(-32768, 32768, t.shape, dtype=torch.int16, device=dev, generator=g)
        if t.fill in ("suh", "svh"):                # random signs times the scale (svh: 1, 0 past the real width)
            s = torch.randint(0, 2, t.shape, device=dev, generator=g).to(torch.float32) * 2 - 1
            if t.fill == "suh":
                return (s * (t.value / self.cb_std)).to(t.dtype)
            s[int(t.value):] = 0
            return s.to(t.dtype)
        if t.fill == "normal":
            return (torch.randn(t.shape, device=dev, generator=g, dtype=torch.float32) * t.value).to(t.dtype)
        if t.fill == "router":                      # rows (experts) scaled by exp(ROUTER_SKEW * z)
            scale = (torch.randn(t.shape[0], generator=self.gens["cpu"]) * ROUTER_SKEW).exp().to(dev)
            return (torch.randn(t.shape, device=dev, generator=g) * t.value * scale[:, None]).to(t.dtype)
        if t.fill == "const":
            return torch.full(t.shape, t.value, dtype=t.dtype, device=dev)
        if t.fill == "marker":
            return torch.tensor(int(t.value), dtype=torch.int32)
        if t.fill == "a_log":                       # log of A ~ U(1, 16), as the HF initialiser draws it
            return torch.empty(t.shape, dtype=torch.float32).uniform_(1.0, 16.0, generator=self.gens["cpu"]).log().to(t.dtype)
        raise RuntimeError(f"{t.name}: unknown fill {t.fill!r}")


class Checker:
    """Keeps the leading block of a few linears as they are written and decodes them with the reference decoder."""

    def __init__(self, plan: Plan, codebook: str, std: float):
        self.keys = set(plan.linears[:CHECKED_LINEARS] + plan.linears[-1:])
        self.parts: dict[str, dict] = {}
        self.codebook, self.std = codebook, std

    def keep(self, t: TensorSpec, x: torch.Tensor) -> torch.Tensor:
        key, _, sub = t.name.rpartition(".")
        if key in self.keys and sub in ("trellis", "suh", "svh"):
            self.parts.setdefault(key, {})[sub] = (x[:8, :8] if sub == "trellis" else x[:128]).cpu()
        return x

    def results(self) -> list[dict]:
        out = []
        for key, p in self.parts.items():
            w = decode_linear(p["trellis"], p["suh"], p["svh"], self.codebook)
            live = w[:, p["svh"] != 0]
            mean, std = float(live.mean()), float(live.std())
            out.append({"tensor": key, "mean": round(mean, 6), "std": round(std, 6), "expected_std": self.std})
            if abs(std / self.std - 1) > CHECK_TOL or abs(mean) > 0.1 * self.std:
                raise RuntimeError(f"{key}: decoded weights have mean {mean:.4g} std {std:.4g}, expected 0 / {self.std:.4g}")
        return out


def quantization_config(o: SynthInputs, plan: Plan) -> dict:
    """quantization_config as exllamav3's compile step writes it, plus a `synthetic` note."""
    q = {"quant_method": "exl3", "version": EXL3_VERSION, "bits": float(o.bits), "head_bits": o.head_bits,
         "out_scales": "auto", "codebook": o.codebook}
    if any(t.name.startswith("mtp.") for t in plan.tensors):
        q["mtp_bits"] = o.mtp_bits
    q["synthetic"] = {"tool": "toolkit.synth", "source_config": str(o.config), "seed": o.seed, "weight_std": o.std,
                      "routing": o.routing, "note": "random trellis codes: the shape and cost of a real checkpoint, not its outputs"}
    return q


def synth(config: str, bits: float, out: str, head_bits: float = 6, codebook: str = "mul1", seed: int = 0,
          std: float | None = None, shard_gb: float = 4.0, device: str | None = None, overwrite: bool = False,
          quiet: bool = False, routing: str = "random", mtp_bits: float = 4) -> dict:
    """Write the checkpoint into `out` atomically; returns a summary (also printed as one JSON line by the CLI)."""
    return write(*check_inputs(config, bits, out, head_bits, codebook, seed, std, shard_gb, device, overwrite, quiet,
                               routing, mtp_bits))


def write(o: SynthInputs, cfg: dict) -> dict:
    """Write the checkpoint of the checked inputs (inputs.check_inputs) and config `cfg`; returns the summary."""
    t0 = time.time()
    plan = build_plan(cfg, o.bits, o.head_bits, o.codebook, o.std, o.mtp_bits)
    if o.routing == "skewed":
        router = lambda t: replace(t, fill="router") if t.name.endswith(".mlp.gate.weight") else t
        plan.groups = [[router(t) for t in g] for g in plan.groups]
    shards = plan_shards(plan.groups, int(o.shard_gb * 1024**3))
    names = shard_names(len(shards))
    make, check = Filler(o.device, o.seed, o.codebook), Checker(plan, o.codebook, o.std)
    with atomic_dir(o.out, command="synth") as tmp:
        check_space(tmp, plan.nbytes)
        bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc=f"synth {o.out.name}", disable=o.quiet, file=sys.stderr)
        staging = Staging()
        with torch.inference_mode(), bar:
            for name, specs in zip(names, shards):
                write_shard(tmp / name, specs, lambda t: check.keep(t, make(t)), bar.update, staging)
        decoded = check.results()
        write_index(tmp, shards)
        cfg_out = {**plan.config, "quantization_config": quantization_config(o, plan)}
        specials = None
        if plan.kind == "qwen3_5_moe":
            sp = write_tokenizer(tmp, plan.vocab_size)
            cfg_out.update(bos_token_id=None, eos_token_id=sp.im_end, pad_token_id=sp.endoftext)
            specials = {"endoftext": sp.endoftext, "im_start": sp.im_start, "im_end": sp.im_end}
        (tmp / "config.json").write_text(json.dumps(cfg_out, indent=2) + "\n")
        for name, content in plan.files.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    if o.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"out": str(o.out), "kind": plan.kind, "bits": o.bits, "head_bits": o.head_bits if plan.kind != "dflash" else None,
            "codebook": o.codebook, "tensors": len(plan.tensors), "linears": len(plan.linears), "bytes": plan.nbytes,
            "size": human(plan.nbytes), "shards": len(shards), "device": o.device, "weight_std": o.std,
            "decoded_check": decoded, "specials": specials, "routing": o.routing,
            "mtp_bits": o.mtp_bits if "mtp_bits" in cfg_out["quantization_config"] else None,
            "seconds": round(time.time() - t0, 1)}
