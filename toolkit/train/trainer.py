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
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

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
from .card import card, lineage
from .objective import chunked_loss, position_weights, sample_anchors
from .optim import OptimState, optimize
from .outputs import check_run, checkpoints, held, remove_checkpoints
from .pieces import (Clock, Run, check_resume, corpus_from, fingerprint, load_best, load_state, missing_best,
                     planned_steps, rebuild_first_moment, restore, save_state)
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


def load_target(path: str, device: str):
    dtype = "auto" if device.startswith("cuda") else torch.float32     # the GPU runs the stored fp16/bf16
    return load_hf_model(path, device, dtype, "--target")


def save_checkpoint(ckdir: Path, model: DFlashDraft, st: OptimState, run: Run) -> None:
    """Weights, optimizer, schedule, RNG and the run's record (evaluations, best so far, pieces): all a resume needs,
    in CKDIR/state/, and the best weights in CKDIR/best/ when they changed (train/checkpoint.py)."""
    save_state(ckdir, model, st, run)


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


def log(cfg: TrainConfig, *a) -> None:
    if not cfg.quiet:
        print(*a, file=sys.stderr, flush=True)


def train_drafter(target: str, out: str, **options) -> dict:
    """Train and write the drafter folder `out` (config.json, bf16 model.safetensors, README.md, heldout.json,
    training.json) atomically; returns training.json's content. `options`: the other TrainConfig fields."""
    cfg = TrainConfig(target, out, **options)
    return train_checked(cfg, *check_run(cfg))                                # checked before any reading or loading


def train_checked(cfg: TrainConfig, outs, tcfg: dict) -> dict:
    """The run once `check_run` has checked it (its outputs, the target's config `tcfg`): one run per folder at a time."""
    with held(outs):
        return train_held(cfg, outs, tcfg)


def train_held(cfg: TrainConfig, outs, tcfg: dict) -> dict:
    """The run once --out is held: read the inputs, train in the checkpoint folder, remove it after the final save
    (kept for a run made in pieces, with --time-limit: for the next piece or an --extend). Resuming a run whose plan is done writes the
    drafter from the checkpoint alone: no target weights or answers are read."""
    t0 = time.time()
    budget = None if cfg.minutes is None else cfg.minutes * 60
    saved = load_state(outs.ckdir) if cfg.resume else None
    if saved is not None and done(cfg, saved[1]):
        tok = load_hf_tokenizer(cfg.target, "--target")
        info = finish(cfg, outs, outs.ckdir, saved, build_config(cfg, tcfg, tok))
    else:
        inputs = read_inputs(cfg)                                             # every input file, checked now
        tok = load_hf_tokenizer(cfg.target, "--target")
        dcfg = build_config(cfg, tcfg, tok)
        conf, vocab = DFlashConfig.from_dict(dcfg), text_config(tcfg)["vocab_size"]
        init = initial_weights(cfg.init, dcfg) if cfg.init is not None and not cfg.resume else None
        ckdir = checkpoints(outs.ckdir, cfg.resume)                           # made only once the inputs are good
        info = train(cfg, outs, inputs, ckdir, tok, dcfg, conf, vocab, init, pick_device(cfg.device), t0, budget, saved)
    if not any(p.get("time_limit") for p in info["pieces"]):                  # a run made in pieces keeps it
        remove_checkpoints(outs.ckdir)
    return info


def plan_of(cfg: TrainConfig, steps_per_epoch: int) -> int:
    return math.ceil(cfg.epochs * steps_per_epoch) if cfg.epochs else cfg.steps


def done(cfg: TrainConfig, record: dict) -> bool:
    """Whether a resumed run has nothing left to train (its plan done, and not raised by --extend)."""
    planned = planned_steps(cfg, record, plan_of(cfg, record["steps_per_epoch"]))
    return record["optim"]["step"] >= record["optim"]["steps"] and planned == record["planned"]


def device_name(dev: str) -> str:
    return torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"


def train(cfg: TrainConfig, outs, inputs, ckdir: Path, tok, dcfg: dict, conf, vocab: int, init, dev: str,
          t0: float, budget: float | None, saved: tuple | None) -> dict:
    """Load the target, answer, train, evaluate and write the drafter (and the curve) for a checked run; with
    --time-limit, one piece of it (the drafter is written by the piece that completes the plan)."""
    torch.manual_seed(cfg.seed)
    tgt = load_target(cfg.target, dev)
    corpus, gen_report = training_answers(cfg, inputs, ckdir, tgt, tok, vocab, t0 + 0.4 * budget if budget else None)
    held = inputs.held
    store = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    batches = Batches(corpus.lengths, cfg.batch_seqs, cfg.seed)
    plan = plan_of(cfg, batches.steps_per_epoch)
    run = Run(drafter_config=dcfg, sequences=len(corpus), fingerprint=fingerprint(corpus), planned=plan,
              steps_per_epoch=batches.steps_per_epoch, evals=[], best=None, pieces=[], heldout_prompts=group(held),
              corpus={"response_tokens": corpus.answer_tokens(), "by_category": {c: corpus.count(c) for c in CATEGORIES}},
              data=gen_report, init=lineage(cfg.init) if cfg.init is not None else None, accuracy=[],
              precision=cfg.checkpoint_precision)
    torch.manual_seed(cfg.seed)
    model = DFlashDraft(conf).to(dev)
    if init is not None:
        model.load_state_dict(init)
    st, piece = OptimState(steps=plan), {"piece": 1, "from": 0, "device": device_name(dev), "time_limit": cfg.time_limit}
    if saved is not None:
        tensors, record = saved
        check_resume(record, dcfg, run["fingerprint"], ckdir)
        plan = planned_steps(cfg, record, plan)
        st = restore(model, tensors, record)
        run.update({k: record[k] for k in ("evals", "best", "pieces", "heldout_prompts", "corpus", "data", "init",
                                           "accuracy")}, planned=plan)
        run.heldout, run.best_weights = corpus_from(tensors, record), load_best(ckdir, record["best"])
        piece.update(piece=len(run["pieces"]) + 1, **{"from": st.step})
        if plan != st.steps and plan != record["planned"]:
            piece["extended"], st.steps = [record["planned"], plan], plan
        st.stopped = ""
    run["pieces"].append(piece)
    log(cfg, f"piece {piece['piece']} of a run planned for {st.steps} steps: from step {st.step}"
        + (f", for at most {cfg.time_limit:g} s" if cfg.time_limit is not None else ""))
    ev = None
    if cfg.eval_every and held:
        if run.heldout is None:
            with tempfile.TemporaryDirectory() as tmp:
                run.heldout, _ = heldout_answers(cfg, Path(tmp), tgt, tok, vocab, held)
        ev = eval_set(tgt, run.heldout, conf, dev, store) if len(run.heldout) else None
    embed = tgt.get_input_embeddings().weight.detach().to(store)
    head = tgt.get_output_embeddings().weight.detach().to(store)
    weights = position_weights(conf.block_size)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.startswith("cuda") else contextlib.nullcontext()
    sizes = sorted({conf.block_size, min(8, conf.block_size)}, reverse=True)
    clock = Clock(t0, cfg.time_limit)

    def loss_at(step: int) -> torch.Tensor:
        ids, lengths, starts = corpus.batch(batches.rows(step), dev)
        taps = target_taps(tgt, ids, lengths, conf).to(store)
        anchors, valid = sample_anchors(starts, lengths, cfg.anchors, step_generator(cfg.seed, step))
        with autocast:
            loss, acc = chunked_loss(model, ids, taps, lengths, anchors, valid, embed, head, weights, cfg.anchor_chunk)
        run["accuracy"] = [round(a, 4) for a in acc.tolist()]
        return loss

    def evaluate(step: int) -> None:
        with autocast:
            r = tf_tau(model, ev, embed, head, sizes, cfg.anchor_chunk)
        run["evals"].append({"step": step, **r})
        if run["best"] is None or r["score"] > run["best"]["score"]:
            run["best"] = {"step": step, "score": r["score"], "tau": r["tau"]}
            run.best_weights = {k: v.detach().to(torch.bfloat16).cpu().clone() for k, v in model.state_dict().items()}
            run.best_unsaved = True
        log(cfg, f"step {step}: teacher-forced tau {json.dumps(r['tau'])} (best: step {run['best']['step']})")

    def checkpoint(s: OptimState) -> None:
        piece.update(to=s.step, seconds=round(time.time() - t0, 1), stopped=s.stopped)
        clock.timed("save_s", save_checkpoint, ckdir, model, s, run)

    def on_step(s: OptimState) -> None:
        if ev is not None and s.step % cfg.eval_every == 0 and s.step < s.steps:
            clock.timed("eval_s", evaluate, s.step)
        if s.step % cfg.checkpoint_every == 0 and s.step < s.steps:
            checkpoint(s)

    deadline = t0 + budget - 10 if budget else None       # 10 s left for the final evaluation and save
    model.train()
    piece["replayed"] = rebuild_first_moment(model, loss_at, st)
    st = optimize(model, lambda: loss_at(st.step), plan, cfg.lr, "drafter", cfg.warmup, st, on_step, deadline, cfg.log_every,
                  quiet=cfg.quiet, stop=clock.over if cfg.time_limit is not None else None)
    complete = st.stopped != "time limit"
    if complete and ev is not None and (not run["evals"] or run["evals"][-1]["step"] != st.step):
        evaluate(st.step)
    if cfg.time_limit is not None:
        checkpoint(st)
    if outs.curve is not None:
        curves.plot(curves.curve(st.losses, run["evals"], run["best"]), outs.curve, f"{Path(cfg.target).name}: {len(corpus):,} answers")
    if not complete:
        log(cfg, f"piece {piece['piece']} saved at step {st.step} of {st.steps} in {ckdir}: continue with --resume")
        return summary(cfg, run, st, written=False)
    best = run.best_weights if run["best"] is not None and run["best"]["step"] != st.step else None
    if run["best"] is not None and run["best"]["step"] != st.step and best is None:
        log(cfg, str(missing_best(ckdir, run["best"])))
        return summary(cfg, run, st, written=False)
    if best is not None:
        model.load_state_dict(best)
    return write_out(cfg, outs, dcfg, model, run, st)


def summary(cfg: TrainConfig, run: Run, st: OptimState, written: bool, params: int | None = None) -> dict:
    """training.json's content (and the command's result): the run so far, over all its pieces."""
    pieces = run["pieces"]
    devices = sorted({p["device"] for p in pieces})
    return {"config": asdict(cfg), "device": ", ".join(devices) or "cpu", "params": params,
            "sequences": run["sequences"], "response_tokens": run["corpus"]["response_tokens"],
            "by_category": run["corpus"]["by_category"], "steps": st.step, "planned_steps": st.steps,
            "epochs": round(st.step / run["steps_per_epoch"], 3), "stopped": st.stopped, "losses": st.losses,
            "accuracy": run["accuracy"], "best": run["best"], "evals": run["evals"],
            "seconds": round(sum(p.get("seconds", 0) for p in pieces), 1), "data": run["data"],
            "pieces": pieces, "piece": pieces[-1]["piece"] if pieces else 0, "complete": st.step >= st.steps,
            "written": written, **({"init": run["init"]} if run["init"] is not None else {})}


def write_out(cfg: TrainConfig, outs, dcfg: dict, model: DFlashDraft, run: Run, st: OptimState) -> dict:
    """The drafter folder --out from `model`: weights in bf16, its card, heldout.json and training.json."""
    info = summary(cfg, run, st, written=True, params=sum(p.numel() for p in model.parameters()))
    extra = {"README.md": card(cfg, dcfg, info), "heldout.json": json.dumps(run["heldout_prompts"], indent=1) + "\n",
             "training.json": json.dumps(info, indent=1) + "\n"}
    save_drafter(model.eval().cpu(), outs.out, dtype=torch.bfloat16, extra_files=extra, command="train_drafter")
    return info


def finish(cfg: TrainConfig, outs, ckdir: Path, saved: tuple, dcfg: dict) -> dict:
    """A run whose plan is done: the drafter written from the checkpoint (the best weights, or the last ones)."""
    tensors, record = saved
    if record.get("drafter_config") != dcfg:
        raise OptionError("resume", f": the checkpoint in {ckdir} is for another drafter shape")
    run = Run({k: v for k, v in record.items() if k not in ("optim", "param_groups", "heldout_answers")})
    st = OptimState(**record["optim"])
    model = DFlashDraft(DFlashConfig.from_dict(dcfg))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    best = record["best"]
    if best is not None and best["step"] != st.step:
        weights = load_best(ckdir, best)
        if weights is None:
            raise missing_best(ckdir, best)
        model.load_state_dict(weights)
    log(cfg, f"the run's plan is done ({st.step} steps): writing the drafter from {ckdir}")
    return write_out(cfg, outs, dcfg, model, run, st)
