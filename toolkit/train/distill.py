"""Self-distillation data: the target's own greedy responses to chat-formatted prompts, and its tap features."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..assets.prompts import Prompt
from ..dflash import DFlashConfig, gather_taps
from ..core.target import TargetInfo
from ..runtime.backend import encode_chat


@dataclass
class Sequences:
    """Prompt + response token ids per sequence; `starts[i]` is the index of sequence i's first response token."""

    ids: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def response_tokens(self) -> int:
        return sum(len(i) - s for i, s in zip(self.ids, self.starts))


def stop_ids(model, tok) -> set[int]:
    return set(TargetInfo.of_model(model, tok).eos_ids)


@torch.inference_mode()
def generate(model, tok, prompts: list[Prompt], max_new_tokens: int, batch_size: int, max_prompt_tokens: int = 512,
             deadline: float | None = None, quiet: bool = False) -> Sequences:
    """Greedy responses in left-padded batches of similar length; prompts over max_prompt_tokens are skipped,
    and batches stop at `deadline` (time.time()), keeping what is done. Responses end at the first stop token."""
    stops = stop_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(stops) if stops else 0)
    enc = [(encode_chat(tok, p.text), p.category) for p in prompts]
    enc = sorted([e for e in enc if len(e[0]) <= max_prompt_tokens], key=lambda e: -len(e[0]))
    out = Sequences()
    dev = model.device
    for k in tqdm(range(0, len(enc), batch_size), desc="generate", unit="batch", disable=quiet):
        if deadline is not None and time.time() > deadline:
            break
        chunk = enc[k : k + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        x = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, (ids, _) in enumerate(chunk):
            x[r, width - len(ids):] = torch.tensor(ids)
            mask[r, width - len(ids):] = 1
        g = model.generate(input_ids=x.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=pad, eos_token_id=sorted(stops) or None)
        for (ids, cat), row in zip(chunk, g[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            if cut >= 2:                           # an anchor needs a response token after it
                out.ids.append(ids + row[:cut])
                out.starts.append(len(ids))
                out.categories.append(cat)
    return out


@torch.inference_mode()
def compute_taps(model, seqs: Sequences, config: DFlashConfig, batch_size: int = 32, dtype: torch.dtype | None = None,
                 quiet: bool = False) -> list[torch.Tensor]:
    """The target's hidden states at the drafter's taps for every sequence: [len, taps*hidden] each, kept on
    the target's device in `dtype` (default the target's)."""
    kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs.ids[i]))
    taps: list[torch.Tensor | None] = [None] * len(seqs)
    for k in tqdm(range(0, len(order), batch_size), desc="taps", unit="batch", disable=quiet):
        rows = order[k : k + batch_size]
        width = len(seqs.ids[rows[0]])
        x = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, i in enumerate(rows):
            x[r, : len(seqs.ids[i])] = torch.tensor(seqs.ids[i])
            mask[r, : len(seqs.ids[i])] = 1
        out = model(input_ids=x.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True, **kw)
        h = gather_taps(out.hidden_states, config)
        for r, i in enumerate(rows):
            taps[i] = h[r, : len(seqs.ids[i])].to(dtype or h.dtype).clone()
    return taps  # type: ignore[return-value]
