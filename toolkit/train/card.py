"""The drafter card (README.md) that `python -m toolkit.train_drafter` writes, and the lineage of a run that
started from an earlier drafter (--init)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core import files
from ..core.errors import ToolkitError
from .config import TrainConfig
from .objective import GAMMA


def lineage(folder: str) -> dict:
    """--init: what the starting drafter had been trained on (its training.json, when it has one), for the card."""
    try:
        t = files.read_json(Path(folder).expanduser() / "training.json")
    except ToolkitError:
        t = None
    return {"folder": str(folder), **(recorded(t) if isinstance(t, dict) else {})}


def recorded(t: dict, depth: int = 0) -> dict:
    """The fields of a training.json the card's lineage uses, of the types train_drafter writes (nested --init too)."""
    out = {k: t[k] for k in ("steps", "sequences", "response_tokens") if type(t.get(k)) is int}
    out.update({k: t[k] for k in ("seconds", "device") if type(t.get(k)) in (int, float, str)})
    up = t.get("init")
    if isinstance(up, dict) and isinstance(up.get("folder"), str) and depth < 16:
        out["init"] = {"folder": up["folder"], **recorded(up, depth + 1)}
    return out


def started_from(init: dict) -> str:
    """The card's line for a run that started from an earlier drafter (nested as far as the records go)."""
    parts = []
    while init:
        done = (f"{init['steps']:,} steps on {init['sequences']:,} answers" if "steps" in init and "sequences" in init
                else "no training record")
        parts.append(f"{Path(init['folder']).name} ({done})")
        init = init.get("init")
    return ("Started from an earlier drafter (--init): " + ", which started from ".join(parts) +
            "; the data, steps and loss above are this run's alone.")


def card(cfg: TrainConfig, dcfg: dict, info: dict) -> str:
    losses = info["losses"]
    picks = losses[:: max(1, len(losses) // 12)]
    curve = ", ".join(f"{s}: {v:.3f}" for s, v in picks + [x for x in losses[-1:] if x not in picks])
    d = dcfg["dflash_config"]
    best = info.get("best")
    kept = (f"Kept: step {best['step']}, the best teacher-forced tau on the held-out prompts (mean of chat and code at "
            f"B={d['block_size']}): {json.dumps(best['tau'])} (train/tf_tau.py; every evaluation in training.json)."
            if best else "Kept: the last step (no tau measured during training).")
    return "\n".join([
        f"# DFlash drafter for {Path(cfg.target).name}", "",
        f"Trained by `python -m toolkit.train_drafter` (toolkit/train, objective of arXiv:2602.06036) in {info['seconds']:.0f} s on {info['device']}"
        + (f", in {len(info['pieces'])} pieces resumed from checkpoints (--time-limit)." if len(info.get("pieces") or []) > 1 else "."),
        f"Shape: {dcfg['num_hidden_layers']} layers ({', '.join(dcfg['layer_types'])}, window {dcfg['sliding_window']}), "
        f"hidden {dcfg['hidden_size']}, intermediate {dcfg['intermediate_size']}, block {d['block_size']}, taps {d['target_layer_ids']} "
        f"(tap_shift 0), mask token {d['mask_token_id']}; {info['params']:,} parameters ({info['params'] * 2 / 1e6:.1f} MB in bf16).",
        f"Data: {info['sequences']:,} target answers ({info['response_tokens']:,} answer tokens; {info['by_category']}), the "
        f"target's own greedy answers (chat template) to ShareGPT chats and stdlib code tasks, at most {cfg.max_new_tokens} new "
        f"tokens; held-out prompts in heldout.json.",
        f"Steps: {info['steps']} of {info['planned_steps']} ({info['stopped'] or 'completed'}; {info['epochs']:.2f} epochs), "
        f"{cfg.batch_seqs} sequences x up to {cfg.anchors} anchors per step (drawn afresh), loss weights exp(-(k-1)/gamma) with "
        f"gamma {GAMMA.get(d['block_size'], 'B/2.3')}, lr {cfg.lr}, seed {cfg.seed}.", f"Loss (step: value): {curve}.",
        f"Top-1 accuracy per block position at the end: {' '.join(f'{a:.2f}' for a in info['accuracy'])}.", kept,
        *([started_from(info["init"])] if info.get("init") else []), "",
        "<!-- tau -->", "tau: not measured yet (`python -m toolkit.eval_tau --target T --draft D --write-card`).", "<!-- /tau -->", ""])
