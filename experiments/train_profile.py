"""Where a drafter training step's time goes (issue 19): the trainer's own step (toolkit/train) timed by part.

The H200 runs of issue 19 drafted only 5-15k blocks a second, and the step time did not scale with the blocks
(~0.3 s a step looked fixed). This times the parts of the very step train_drafter runs (the batch on the host, the
target's taps, the chunked loss forward + backward, the optimizer) for a few batch shapes, then lists the top
operators of the default shape under torch.profiler.

Device, after `experiments.smol_scale gen`, or after `experiments.smol_device stage` with a kept store's parts in
/tmp/store-parts (unpacked here into /tmp/smol-scale/data, where `smol_scale train` finds them), same warm machine:
    python3 -m experiments.train_profile
Here (CPU, small): python -m experiments.train_profile --target ~/.cache/dflash-toolkit/smollm2-135m-instruct
    --data /tmp/q19/data --device cpu --shapes 2x8x8 --steps 2
Writes $OUT/train_profile.json (per shape: median ms per part, blocks a step, blocks a second; the profiler table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from experiments.harness import Run, device_name
from experiments.smol_scale import PARTS, unpack_store

SHAPES = ["16x512x128", "16x512x512", "64x16x16", "32x128x128", "64x512x128"]   # sequences x anchors x chunk


def sync(dev: str) -> float:
    import torch

    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def profile_shapes(target: Path, data: Path, device: str, shapes: list[str], steps: int, table: bool) -> dict:
    import numpy as np
    import torch

    from toolkit.dflash import DFlashConfig, DFlashDraft
    from toolkit.runtime.torch_backend import load_hf_tokenizer
    from toolkit.train.distill import target_taps
    from toolkit.train.objective import chunked_loss, position_weights, sample_anchors
    from toolkit.train.store import AnswerStore
    from toolkit.train.trainer import TrainConfig, build_config, load_target, step_generator
    from toolkit.core.folders import read_config

    tok = load_hf_tokenizer(str(target))
    dcfg = build_config(TrainConfig(str(target), "/dev/null"), read_config(str(target), "target"), tok)
    conf = DFlashConfig.from_dict(dcfg)
    tgt = load_target(str(target), device)
    corpus = AnswerStore(data).load()
    store = torch.bfloat16 if device.startswith("cuda") else torch.float32
    embed = tgt.get_input_embeddings().weight.detach().to(store)
    head = tgt.get_output_embeddings().weight.detach().to(store)
    model = DFlashDraft(conf).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    weights = position_weights(conf.block_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()
    rng = np.random.default_rng(0)
    out: dict = {"sequences": len(corpus), "shapes": {}}

    def step(seqs: int, anchors: int, chunk: int, k: int) -> dict:
        t0 = sync(device)
        ids, lengths, starts = corpus.batch(rng.choice(len(corpus), seqs, replace=False), device)
        a, v = sample_anchors(starts, lengths, anchors, step_generator(0, k))
        t1 = sync(device)
        with torch.no_grad():
            taps = target_taps(tgt, ids, lengths, conf).to(store)
        t2 = sync(device)
        opt.zero_grad()
        with autocast:
            chunked_loss(model, ids, taps, lengths, a, v, embed, head, weights, chunk)
        t3 = sync(device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t4 = sync(device)
        return {"batch": t1 - t0, "taps": t2 - t1, "loss": t3 - t2, "optim": t4 - t3, "blocks": int(v.sum()),
                "tokens": int(lengths.sum())}

    for shape in shapes:
        seqs, anchors, chunk = (int(x) for x in shape.split("x"))
        step(seqs, anchors, chunk, 0)                                 # warm-up: allocator, kernels
        runs = [step(seqs, anchors, chunk, k) for k in range(1, steps + 1)]
        med = {p: round(1000 * statistics.median(r[p] for r in runs), 2) for p in ("batch", "taps", "loss", "optim")}
        total = sum(med.values()) / 1000
        blocks = statistics.median(r["blocks"] for r in runs)
        out["shapes"][shape] = {"ms": med, "step_ms": round(1000 * total, 1), "blocks": blocks,
                                "tokens": statistics.median(r["tokens"] for r in runs),
                                "blocks_per_s": round(blocks / total), "steps_per_s": round(1 / total, 2)}
        print(shape, json.dumps(out["shapes"][shape]), flush=True)
    if table:
        seqs, anchors, chunk = (int(x) for x in shapes[0].split("x"))
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with torch.profiler.profile(activities=acts) as prof:
            for k in range(3):
                step(seqs, anchors, chunk, 100 + k)
        key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
        out["profile"] = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.train_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("/tmp/smol-run/smollm2-135m-instruct"),
                    help="the prepared SmolLM2 target (default /tmp/smol-run/smollm2-135m-instruct)")
    ap.add_argument("--data", type=Path, default=Path("/tmp/smol-scale/data"), help="answer store (default /tmp/smol-scale/data)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help=f"SEQSxANCHORSxCHUNK per step (default {' '.join(SHAPES)})")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per shape after one warm-up (default 8)")
    ap.add_argument("--no-table", action="store_true", help="skip the torch.profiler table")
    ap.add_argument("--budget-s", type=float, default=240, help="the call's budget (default 240)")
    a = ap.parse_args(argv)
    run = Run("train_profile.json", budget_s=a.budget_s, section="stages")
    run.results.update(device=device_name())
    if not (a.data / "index.json").is_file() and list(PARTS.glob("store.tar.xz.*")):   # a kept store carried as parts
        run.step("unpack_store", unpack_store, PARTS, a.data.parent)
    run.step("profile", profile_shapes, a.target, a.data, a.device, a.shapes, a.steps, not a.no_table)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
