"""Build the trained tiny pair shipped in toolkit/data/tiny_pair: `python -m toolkit.tiny_pair`.

Deterministic from --seed on one torch version. Steps: a byte-level BPE tokenizer trained on stdlib
docstrings; a 3-layer Llama target (hidden 128) trained for a few minutes on them as chat turns (ask for
`json.dumps`, get its docstring); a 2-layer DFlash drafter (sliding + full layer, block 16) trained against the target's
hidden states to predict the target's own greedy continuations. Loss weights decay with block position,
exp(-(k-1)/gamma), as in the DFlash paper (gamma 7 for block 16). The optimiser, loss weights and block
sampling are toolkit/train's, shared with `python -m toolkit.train_drafter` (real targets).
"""

from __future__ import annotations

import inspect
import importlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..dflash import DFlashConfig, DFlashDraft, gather_taps, save_drafter
from ..core.folders import atomic_dir
from ..assets.fixtures import CHAT_TEMPLATE, MASK_TOKEN, target_config
from ..assets.pairs import PAIR
from ..dflash.shapes import drafter_config
from . import block_batch, optimize, position_weights  # noqa: F401  (position_weights: re-exported)

MODULES = ["argparse", "collections", "json", "pathlib", "textwrap", "functools", "itertools", "string", "random",
           "datetime", "shutil", "subprocess", "logging", "unittest", "email", "http.client", "urllib.parse", "csv",
           "inspect", "typing", "dataclasses", "enum", "re", "os", "tarfile", "zipfile", "threading", "asyncio"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]


def docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) for a fixed list of stdlib modules, their classes and functions."""
    docs: list[tuple[str, str]] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        docs.append((name, inspect.getdoc(mod) or ""))
        for attr, obj in sorted(vars(mod).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                docs.append((f"{name}.{attr}", inspect.getdoc(obj) or ""))
    return [(n, d.strip()) for n, d in docs if d and d.strip()]


def corpus() -> str:
    """The docstrings as chat turns: the user names an object, the assistant answers with its docstring."""
    return "".join(f"<|im_start|>user\n{n}<|im_end|>\n<|im_start|>assistant\n{d}<|im_end|>\n\n" for n, d in docstrings())


def train_tokenizer(text: str, out: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.split("\n\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", MASK_TOKEN])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def train_target(ids: torch.Tensor, cfg: dict, steps: int, seq: int = 128, batch: int = 32, lr: float = 3e-3):
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)

    def loss():
        starts = torch.randint(0, len(ids) - seq - 1, (batch,))
        x = torch.stack([ids[s : s + seq] for s in starts])
        return model(input_ids=x, labels=x).loss

    optimize(model, loss, steps, lr, "target")
    return model.eval()


@torch.no_grad()
def self_distill(model, ids: torch.Tensor, n: int, prompt_len: int = 32, gen_len: int = 96) -> torch.Tensor:
    """Sequences of a corpus prompt followed by the target's own greedy continuation."""
    starts = torch.randint(0, len(ids) - prompt_len, (n,))
    prompts = torch.stack([ids[s : s + prompt_len] for s in starts])
    out = []
    for chunk in tqdm(prompts.split(64), desc="distill", unit="batch"):
        g = model.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=gen_len, min_new_tokens=gen_len,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
        out.append(g)
    return torch.cat(out)


def train_drafter(target, seqs: torch.Tensor, dcfg: dict, steps: int, batch: int = 128, lr: float = 3e-3, min_ctx: int = 31) -> DFlashDraft:
    torch.manual_seed(1)
    model = DFlashDraft(DFlashConfig.from_dict(dcfg))
    cfg = model.config
    with torch.no_grad():
        taps = torch.cat([gather_taps(target(input_ids=c, output_hidden_states=True).hidden_states, cfg) for c in seqs.split(64)])
    emb, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings()
    for p in target.parameters():
        p.requires_grad_(False)
    w = position_weights(cfg.block_size)
    def loss():
        ids, labels, ctx, keep, pos = block_batch(seqs, taps, cfg.block_size, cfg.mask_token_id, batch, min_ctx)
        logits = head(model(F.embedding(ids, emb), ctx, pos, ctx_keep=keep)[:, 1:])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
        return (ce * w).sum() / (w.sum() * len(ids))

    optimize(model, loss, steps, lr, "drafter")
    return model.eval()


def build_pair(out: str = str(PAIR), seed: int = 0, target_steps: int = 1500, draft_steps: int = 3000, sequences: int = 3072) -> Path:
    """Build tokenizer, target and drafter into `out` (replacing it only when everything succeeded)."""
    torch.manual_seed(seed)
    t0 = time.time()
    final = Path(out)
    with atomic_dir(final) as work:
        text = corpus()
        tok = train_tokenizer(text, work / "target")
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
        sp = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
        tcfg = target_config("llama", len(tok), 128, 3, sp["<|im_end|>"], sp["<|endoftext|>"])
        tcfg["initializer_range"] = 0.02
        torch.manual_seed(seed)
        target = train_target(ids, tcfg, target_steps)
        target.to(torch.bfloat16).save_pretrained(str(work / "target"))   # shipped in bf16 (< 2 MB with the drafter)
        target.float()
        torch.manual_seed(seed + 1)
        seqs = self_distill(target, ids, sequences)
        dcfg = drafter_config(128, [0, 1], sp[MASK_TOKEN], 16, layers=2, vocab_size=len(tok), window=32, target_layers=3,
                              intermediate=128)
        drafter = train_drafter(target, seqs, dcfg, draft_steps)
        card = (f"# tiny trained DFlash pair\n\nBuilt by `python -m toolkit.tiny_pair --seed {seed} --target-steps {target_steps} "
                f"--draft-steps {draft_steps} --sequences {sequences}` with torch {torch.__version__} in {time.time() - t0:.0f} s.\n"
                "Target: 3-layer Llama (hidden 128, K/V width 128 so exllamav3 loads it) trained on stdlib docstrings as chat\n"
                "turns (user: a name such as json.dumps; assistant: its docstring). Drafter: 2 layers (sliding window 32 +\n"
                "full), block 16, taps [0, 1],\n"
                "tap_shift 0, trained on the target's greedy continuations of 32-token corpus windows.\n")
        save_drafter(drafter, work / "draft", dtype=torch.bfloat16, extra_files={"README.md": card})
        (work / "README.md").write_text(card)
    print(json.dumps({"out": str(final), "seconds": round(time.time() - t0, 1)}))
    return final
