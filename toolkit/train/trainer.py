"""`python -m toolkit.train_drafter`: train a DFlash drafter (upstream layout) for any local HF target folder.

Data: the target's own greedy answers (chat template) to ShareGPT chats and stdlib code tasks, generated in large
batches (train/batchgen.py) into a resumable answer store, here or beforehand (--data); a fixed held-out set of
each kind is never trained on and is saved as heldout.json for `python -m toolkit.eval_tau`. Objective: the DFlash
block cross-entropy, position-weighted, with up to --anchors anchors per sequence drawn afresh at every step and
run in chunks (train/objective.py says where each choice comes from). Every --eval-every steps a teacher-forced tau
on the held-out prompts (train/tf_tau.py) is measured and the best checkpoint by it is kept, not the last.
Deterministic from --seed on one device (except with --minutes, which fits the step count to the clock);
checkpoints every N steps (--resume continues the run, also in another process).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..core import files
from ..core.errors import OptionError, ToolkitError
from ..core.folders import read_config
from ..core.target import text_config
from ..dflash import DFlashConfig, DFlashDraft, load_drafter, save_drafter
from ..dflash.shapes import drafter_config, spread_taps
from ..runtime.hf import load_hf_model, load_hf_tokenizer
from . import curve as curves
from .config import DATA, MEASURE, OPT, RUN, SHAPE, TrainConfig  # noqa: F401  (the options live apart)
from .data import CATEGORIES
from .distill import target_taps
from .objective import GAMMA, chunked_loss, position_weights, sample_anchors
from .optim import OptimState, optimize
from .outputs import checkpoints, claim_outputs, held, remove_checkpoints, save_torch
from .prepare import group, heldout_answers, read_inputs, training_answers
from .tf_tau import eval_set, tf_tau


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError("device", f"{device}: CUDA is not available")
    return device


def mask_token_id(tok, mask_token: str | None, vocab_size: int) -> int:
    """--mask-token as an id or token; else the tokenizer's mask, <|mask|>, or its last spare special token
    (not BOS/EOS/PAD/UNK, not in the chat template)."""
    if mask_token is not None:
        mid = int(mask_token) if mask_token.isdigit() else tok.convert_tokens_to_ids(mask_token)
        if mid is None or not 0 <= mid < vocab_size or (not mask_token.isdigit() and mid == tok.unk_token_id and mask_token != tok.unk_token):
            raise OptionError("mask_token", f": {mask_token!r} is not a token of the target's vocabulary (size {vocab_size})")
        return mid
    if tok.mask_token_id is not None:
        return tok.mask_token_id
    vocab = tok.get_vocab()
    if "<|mask|>" in vocab:
        return vocab["<|mask|>"]
    used = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    template = tok.chat_template or ""
    spare = [i for i, t in sorted(tok.added_tokens_decoder.items(), reverse=True)
             if i not in used and str(t) not in template and i < vocab_size]
    if not spare:
        raise ToolkitError("the target's tokenizer has no spare special token for the mask; pass --mask-token")
    return spare[0]


def build_config(cfg: TrainConfig, tcfg: dict, tok) -> dict:
    """The drafter's config.json (dflash.shapes.drafter_config layout) at the target's width and head shape."""
    t = text_config(tcfg)
    layers, hidden, vocab = t["num_hidden_layers"], t["hidden_size"], t["vocab_size"]
    taps = cfg.taps if cfg.taps is not None else spread_taps(layers, cfg.num_taps)
    d = drafter_config(hidden, list(taps), mask_token_id(tok, cfg.mask_token, vocab), cfg.block_size, cfg.layers, vocab,
                       cfg.window, layers, cfg.intermediate or t.get("intermediate_size") or 2 * hidden)
    heads = t.get("num_attention_heads", 4)
    d.update(num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads") or heads,
             head_dim=t.get("head_dim") or hidden // heads, rms_norm_eps=t.get("rms_norm_eps", 1e-6),
             max_position_embeddings=t.get("max_position_embeddings", 4096))
    DFlashConfig.from_dict(d).validate_against(tcfg)
    return d


def initial_weights(folder: str, dcfg: dict) -> dict:
    """--init: the state dict of a drafter folder whose config is this run's drafter config (same shape and taps)."""
    have = read_config(folder, "init")
    diff = sorted(k for k in set(dcfg) | set(have) if k not in ("torch_dtype", "transformers_version") and dcfg.get(k) != have.get(k))
    if diff:
        raise OptionError("init", f": {folder} is a drafter of another shape ({', '.join(diff[:4])} differ)")
    return {k: v.float() for k, v in load_drafter(folder, what="--init").state_dict().items()}


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


def load_target(path: str, device: str):
    dtype = "auto" if device.startswith("cuda") else torch.float32     # the GPU runs the stored fp16/bf16
    return load_hf_model(path, device, dtype, "--target")


def save_checkpoint(ckdir: Path, model: DFlashDraft, st: OptimState, run: dict) -> None:
    """Weights, optimizer, schedule and the run's record (evaluations, best so far): all a resume needs."""
    state = {k: v for k, v in asdict(st).items() if k != "optimizer"}
    save_torch({"model": model.state_dict(), "optim": state, "optimizer": st.optimizer, **run}, ckdir / "ckpt.pt")


class Batches:
    """Each epoch: the sequences shuffled (seeded by seed and epoch), sorted by length within pools of 64 batches so a
    batch pads little, cut into batches, the batches shuffled. Step s is batch s mod steps_per_epoch of epoch
    s // steps_per_epoch, so a resumed run sees the very batches an uninterrupted one would."""

    def __init__(self, lengths: np.ndarray, batch: int, seed: int, pool: int = 64):
        self.lengths, self.batch, self.seed, self.pool = lengths, batch, seed, pool
        self.steps_per_epoch = sum(math.ceil(min(batch * pool, len(lengths) - k) / batch)
                                   for k in range(0, len(lengths), batch * pool))
        self._epoch, self._order = -1, []

    def rows(self, step: int) -> np.ndarray:
        epoch = step // self.steps_per_epoch
        if epoch != self._epoch:
            g = np.random.default_rng([self.seed, epoch])
            perm, order = g.permutation(len(self.lengths)), []
            for k in range(0, len(perm), self.batch * self.pool):
                part = perm[k : k + self.batch * self.pool]
                part = part[np.argsort(self.lengths[part], kind="stable")]
                order += [part[i : i + self.batch] for i in range(0, len(part), self.batch)]
            self._epoch, self._order = epoch, [order[i] for i in g.permutation(len(order))]
        return self._order[step % self.steps_per_epoch]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The anchors' random source of one step: a function of (seed, step) only, so resuming changes nothing."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))


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
        f"Trained by `python -m toolkit.train_drafter` (toolkit/train, objective of arXiv:2602.06036) in {info['seconds']:.0f} s on {info['device']}.",
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


def log(cfg: TrainConfig, *a) -> None:
    if not cfg.quiet:
        print(*a, file=sys.stderr, flush=True)


def train_drafter(target: str, out: str, **options) -> dict:
    """Train and write the drafter folder `out` (config.json, bf16 model.safetensors, README.md, heldout.json,
    training.json) atomically; returns training.json's content. `options`: the other TrainConfig fields."""
    cfg = TrainConfig(target, out, **options)
    cfg.check()
    outs = claim_outputs(cfg.out, cfg.checkpoint_dir, cfg.curve, cfg.force)   # before any reading or loading
    with held(outs):                                                          # one run per folder at a time
        return train_held(cfg, outs)


def train_held(cfg: TrainConfig, outs) -> dict:
    """The run once --out is held: read the inputs, train in the checkpoint folder, remove it after the final save."""
    t0 = time.time()
    budget = None if cfg.minutes is None else cfg.minutes * 60
    tcfg = read_config(cfg.target, "target")
    inputs = read_inputs(cfg)                                                 # every input file, checked now
    tok = load_hf_tokenizer(cfg.target, "--target")
    dcfg = build_config(cfg, tcfg, tok)
    conf, vocab = DFlashConfig.from_dict(dcfg), text_config(tcfg)["vocab_size"]
    init = initial_weights(cfg.init, dcfg) if cfg.init is not None and not cfg.resume else None
    dev = pick_device(cfg.device)
    ckdir = checkpoints(outs.ckdir, cfg.resume)
    info = train(cfg, outs, inputs, ckdir, tcfg, tok, dcfg, conf, vocab, init, dev, t0, budget)
    remove_checkpoints(outs.ckdir)
    return info


def train(cfg: TrainConfig, outs, inputs, ckdir: Path, tcfg: dict, tok, dcfg: dict, conf, vocab: int, init, dev: str,
          t0: float, budget: float | None) -> dict:
    """Load the target, answer, train, evaluate and write the drafter (and the curve) for a checked run."""
    torch.manual_seed(cfg.seed)
    tgt = load_target(cfg.target, dev)
    corpus, gen_report = training_answers(cfg, inputs, ckdir, tgt, tok, vocab, t0 + 0.4 * budget if budget else None)
    held = inputs.held
    store = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    ev = None
    if cfg.eval_every and held:
        answers, _ = heldout_answers(cfg, ckdir, tgt, tok, vocab, held)
        ev = eval_set(tgt, answers, conf, dev, store) if len(answers) else None
    embed = tgt.get_input_embeddings().weight.detach().to(store)
    head = tgt.get_output_embeddings().weight.detach().to(store)

    torch.manual_seed(cfg.seed)
    model = DFlashDraft(conf).to(dev)
    if init is not None:
        model.load_state_dict(init)
    batches = Batches(corpus.lengths, cfg.batch_seqs, cfg.seed)
    planned = math.ceil(cfg.epochs * batches.steps_per_epoch) if cfg.epochs else cfg.steps
    st = OptimState(steps=planned)
    run = {"drafter_config": dcfg, "sequences": len(corpus), "evals": [], "best": None}
    if cfg.resume:
        ck = torch.load(ckdir / "ckpt.pt", weights_only=False)
        if ck["drafter_config"] != dcfg or ck["sequences"] != len(corpus):
            raise OptionError("resume", f": the checkpoint in {ckdir} is for another drafter shape or other answers")
        model.load_state_dict(ck["model"])
        st = OptimState(**ck["optim"], optimizer=ck["optimizer"])
        run.update(evals=ck["evals"], best=ck["best"])
    weights = position_weights(conf.block_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.startswith("cuda") else contextlib.nullcontext()
    sizes = sorted({conf.block_size, min(8, conf.block_size)}, reverse=True)
    acc_log: list = []

    def loss_fn() -> torch.Tensor:
        ids, lengths, starts = corpus.batch(batches.rows(st.step), dev)
        taps = target_taps(tgt, ids, lengths, conf).to(store)
        anchors, valid = sample_anchors(starts, lengths, cfg.anchors, step_generator(cfg.seed, st.step))
        with autocast:
            loss, acc = chunked_loss(model, ids, taps, lengths, anchors, valid, embed, head, weights, cfg.anchor_chunk)
        acc_log[:] = [acc]
        return loss

    def evaluate(step: int) -> None:
        with autocast:
            r = tf_tau(model, ev, embed, head, sizes, cfg.anchor_chunk)
        run["evals"].append({"step": step, **r})
        if run["best"] is None or r["score"] > run["best"]["score"]:
            run["best"] = {"step": step, "score": r["score"], "tau": r["tau"]}
            save_torch({k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}, ckdir / "best.pt")
        log(cfg, f"step {step}: teacher-forced tau {json.dumps(r['tau'])} (best: step {run['best']['step']})")

    def on_step(s: OptimState) -> None:
        if ev is not None and s.step % cfg.eval_every == 0 and s.step < s.steps:
            evaluate(s.step)
        if s.step % cfg.checkpoint_every == 0 and s.step < s.steps:
            save_checkpoint(ckdir, model, s, run)

    deadline = t0 + budget - 10 if budget else None       # 10 s left for the final evaluation and save
    model.train()
    st = optimize(model, loss_fn, planned, cfg.lr, "drafter", cfg.warmup, st, on_step, deadline, cfg.log_every, quiet=cfg.quiet)
    if ev is not None and (not run["evals"] or run["evals"][-1]["step"] != st.step):
        evaluate(st.step)
    if run["best"] is not None and run["best"]["step"] != st.step:
        model.load_state_dict(torch.load(ckdir / "best.pt"))
    params = sum(p.numel() for p in model.parameters())
    info = {"config": asdict(cfg), "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
            "params": params, "sequences": len(corpus), "response_tokens": corpus.answer_tokens(),
            "by_category": {c: corpus.count(c) for c in CATEGORIES}, "steps": st.step, "planned_steps": st.steps,
            "epochs": round(st.step / batches.steps_per_epoch, 3), "stopped": st.stopped, "losses": st.losses,
            "accuracy": [round(a, 4) for a in acc_log[0].tolist()] if acc_log else [], "best": run["best"],
            "evals": run["evals"], "seconds": round(time.time() - t0, 1), "data": gen_report,
            **({"init": lineage(cfg.init)} if cfg.init is not None else {})}
    extra = {"README.md": card(cfg, dcfg, info), "heldout.json": json.dumps(group(held), indent=1) + "\n",
             "training.json": json.dumps(info, indent=1) + "\n"}
    save_drafter(model.eval().cpu(), outs.out, dtype=torch.bfloat16, extra_files=extra, command="train_drafter")
    if outs.curve is not None:
        curves.plot(curves.curve(st.losses, run["evals"], run["best"]), outs.curve, f"{Path(cfg.target).name}: {len(corpus):,} answers")
    return info
