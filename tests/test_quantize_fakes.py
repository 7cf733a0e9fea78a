"""Stand-ins for exllamav3 at its two seams: convert_model (patched in at toolkit.quant.convert.run_converter)
and, for an EXL3 target, toolkit.quant.engine.ENGINE (FakeEngine, below).

The converter fake parses the same arguments, writes what compile_model writes (config.json +
quantization_config, safetensors with every norm kept) and rounds each Linear to `bits` (per-row uniform grid)
so the check has real error to measure. Its Linears are stored as 16-bit `.weight`, which the check loads
without exllamav3. The engine fake runs the EXL3 target as the transformers model it was copied from, so the
EXL3 path must give the BF16 path's numbers.
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


# -- exllamav3 at run time: the one seam toolkit.quant.engine.ENGINE ------------------------------------------


class FakeExl3Target:
    """runtime.exl3_taps.Exl3Target over a transformers model: the output of layer L is hidden_states[L + 1]."""

    def __init__(self, hf_dir, events: list):
        from toolkit.quant.blocks import load_target

        self.model, _ = load_target(hf_dir)
        self.vocab_size, self.hidden_size = self.model.config.vocab_size, self.model.config.hidden_size
        self.events = events

    def continue_greedy(self, prompts, max_new_tokens):
        out = []
        for p in prompts:
            x = torch.tensor([p])
            with torch.no_grad():
                y = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                        do_sample=False, pad_token_id=0)
            out.append(y[0].tolist())
        return out

    def forward(self, ids, layers):
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        return out.logits[0].argmax(-1), {L: out.hidden_states[L + 1] for L in layers}

    def embedding_table(self):
        return self.model.get_input_embeddings().weight.detach().clone()

    def head_weight(self):
        return self.model.get_output_embeddings().weight.detach().clone()

    def close(self):
        self.events.append("close_target")


class FakeEngine:
    """engine.Exl3Engine on CPU: the target alone is FakeExl3Target, the target with a drafter the torch backend
    (swap_draft replaces its drafter); `events` records loads, swaps, closes and (through the converter fake)
    conversions, in order."""

    def __init__(self, hf_dir, free: int = 80 * 1024**3, why: str | None = None):
        self.hf_dir, self.free, self.why = hf_dir, free, why
        self.events: list[str] = []
        self.calls: list[dict] = []

    def unavailable(self, target):
        return self.why

    def free_bytes(self):
        return self.free

    def open_target(self, folder, cache_tokens, max_concurrency, max_chunk=None):
        assert cache_tokens % 256 == 0 and max_concurrency >= 1 and (max_chunk or 256) % 256 == 0
        self.calls.append({"target": Path(folder), "cache_tokens": cache_tokens, "max_concurrency": max_concurrency,
                           "max_chunk": max_chunk})
        self.events.append("open_target")
        return FakeExl3Target(self.hf_dir, self.events)

    def open_backend(self, target, draft, cache_tokens, max_concurrency):
        from toolkit.dflash import DFlashConfig
        from toolkit.quant.blocks import load_target
        from toolkit.quant.check import load_quantized
        from toolkit.runtime.torch_backend import TorchBackend

        self.calls.append({"target": Path(target), "draft": Path(draft), "cache_tokens": cache_tokens,
                           "max_concurrency": max_concurrency})
        self.events.append(f"open_backend:{Path(draft).name}")
        model, tok = load_target(self.hf_dir)          # an EXL3 drafter folder dequantized as the check loads it
        be = TorchBackend(model, tok, load_quantized(Path(draft), DFlashConfig.from_dir(draft)))
        be.draft_name = Path(draft).name
        be.close = lambda: self.events.append(f"close_backend:{be.draft_name}")
        return be

    def swap_draft(self, backend, draft):
        from toolkit.dflash import DFlashConfig
        from toolkit.quant.check import load_quantized

        self.events.append(f"swap:{backend.draft_name}->{Path(draft).name}")
        backend.drafter = load_quantized(Path(draft), DFlashConfig.from_dir(draft))
        backend.draft_name = Path(draft).name
        backend.book.policies.clear()


def install_engine(monkeypatch, hf_dir, **kw) -> FakeEngine:
    """Replace toolkit.quant.engine.ENGINE; conversions are logged into the same event list."""
    from toolkit.quant import convert as conv
    from toolkit.quant import engine

    fake = FakeEngine(hf_dir, **kw)
    monkeypatch.setattr(engine, "ENGINE", fake)
    inner = conv.run_converter

    def logged(args, log_path):
        fake.events.append("convert:" + Path(args[args.index("-o") + 1]).name)
        return inner(args, log_path)

    monkeypatch.setattr(conv, "run_converter", logged)
    return fake


def exl3_target(hf_dir, dest, bits: float = 4.0, **config) -> Path:
    """An EXL3-shaped copy of a transformers target: its config with exllamav3's quantization_config, its tokenizer
    and weights (which only the stand-in engine reads)."""
    import shutil

    shutil.copytree(hf_dir, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    cfg["quantization_config"] = {"quant_method": "exl3", "version": "1.6.5", "bits": bits, "head_bits": 6}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest
