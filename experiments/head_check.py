"""Issue 17: the EXL3 target's LM head as runtime/exl3_taps.Exl3Target.head_weight reads it (identity rows through
the head's own kernel, HEAD_ROWS at a time) against exllamav3's get_weight_tensor (the whole head dequantized at
once), on a synthetic Qwen3.6-35B-A3B target cut to 4 layers: the same 248k x 2048 head at 6 bits.

Per read: seconds and torch's peak GPU memory above what was allocated before it; then how far the two heads are
apart (max and mean |difference|, the share of equal entries) and how far logits computed with the read head are
from the head's own forward on random hidden states. One call, carry [".device"]:

    source .device/on-device.sh && timeout 300 python -m experiments.head_check        # writes $OUT/head_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.harness import Run

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/head-check")


def small_shape(layers: int, out: Path) -> Path:
    """The Qwen3.6-35B-A3B shape with its first `layers` layers only (the head and embedding unchanged)."""
    cfg = json.loads((ROOT / "quantize" / "shapes" / "qwen3.6-35b-a3b.json").read_text())
    cfg.pop("_source", None)
    t = cfg["text_config"]
    t["num_hidden_layers"], t["layer_types"] = layers, t["layer_types"][:layers]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out / "config.json"


def timed_peak(fn):
    """(result, seconds, peak GiB above the allocation before the call)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before, t0 = torch.cuda.memory_allocated(), time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, round(time.perf_counter() - t0, 3), round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)


def compare(work: Path, layers: int) -> dict:
    import torch

    from toolkit.exl3.taps import open_target
    from toolkit.synthetic.build import synth

    target = work / "target"
    if not (target / "config.json").is_file():
        synth(str(small_shape(layers, work / "shape")), 4.0, str(target), quiet=True)
    t = open_target(target, cache_tokens=1024, max_concurrency=1)
    try:
        lm = t.model.modules[t.model.logit_layer_idx]
        new, new_s, new_gib = timed_peak(t.head_weight)

        def whole():
            with torch.inference_mode():
                w = lm.inner.get_weight_tensor().cpu()
            return w.T[: t.vocab_size, : t.hidden_size].contiguous()

        old, old_s, old_gib = timed_peak(whole)
        diff = (new.float() - old.float()).abs()
        x = torch.randn(16, int(lm.inner.in_features), dtype=torch.half, device=lm.device)
        with torch.inference_mode():
            ref = lm.inner.forward(x, {}, out_dtype=torch.float)[:, : t.vocab_size].cpu()
        xs = x[:, : t.hidden_size].float().cpu()
        logit_err = {name: round(float((xs @ w.float().T - ref).abs().max()), 5) for name, w in (("new", new), ("old", old))}
        return {"head": list(new.shape), "new": {"seconds": new_s, "peak_gib": new_gib},
                "old": {"seconds": old_s, "peak_gib": old_gib},
                "max_abs_diff": round(float(diff.max()), 6), "mean_abs_diff": float(diff.mean()),
                "equal_share": round(float((diff == 0).float().mean()), 6),
                "weight_abs_mean": float(old.float().abs().mean()),
                "logits_max_abs_err_vs_kernel": logit_err, "logits_abs_mean": float(ref.abs().mean())}
    finally:
        t.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.head_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=WORK, help="scratch folder (default /tmp/head-check)")
    p.add_argument("--layers", type=int, default=4, help="target layers kept (default 4)")
    p.add_argument("--budget-s", type=float, default=280.0)
    a = p.parse_args(argv)
    run = Run("head_check.json", budget_s=a.budget_s)
    run.step("compare", compare, a.work, a.layers)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
