"""Batched greedy generation with plain transformers: the target's own answers, hundreds at a time.

One batch is a set of prompts of similar length (pools of pending prompts are sorted by token count), left-padded, with
per-row positions, decoded step by step into a static KV cache sized prompt + max_new_tokens, so no step grows or
copies the cache. Rows stop at their first stop token; every `CHECK` steps the finished rows are counted (one host
sync) and, once a quarter of the rows is done, dropped from the batch and the cache. Greedy picks are the argmax of
each row's own logits, so the tokens equal unbatched generation (tests/test_train_scale.py checks it on CPU fp32).
A decode step reads the whole static cache, so with grouped-query attention (SmolLM2: 9 query, 3 K/V heads) the
steps attend per K/V head with its query heads as rows (`grouped_decode`) instead of transformers' repeat_kv, which
copies the cache three times over at every layer of every step (the same sums; only the memory traffic differs).
`generate_into` answers prompts into an AnswerStore batch by batch, skipping those already stored, until a
deadline, and reports answers per second; a batch that runs out of GPU memory is split in two and retried.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..assets.prompts import Prompt
from ..core.target import TargetInfo
from ..runtime.backend import encode_chat
from .store import AnswerStore, Row, item_key, prompt_key

CHECK = 16                          # decode steps between looks at which rows are done
COMPACT = 0.25                      # drop finished rows once this share of the batch is done
POOL = 16                           # batches sorted by length together (see `batches`)


@dataclass
class GenStats:
    """What one generate_into call did."""

    answers: int = 0
    tokens: int = 0                 # answer tokens
    skipped: int = 0                # prompts over the prompt-token limit (stored empty, never retried)
    already: int = 0                # prompts found in the store
    pending: int = 0                # prompts left when the deadline came
    seconds: float = 0.0            # in all
    encode_seconds: float = 0.0     # of which tokenizing the prompts

    def rate(self) -> dict:
        """Answers and answer tokens per second of generation (tokenizing left out)."""
        s = max(self.seconds - self.encode_seconds, 1e-9)
        return {"answers_per_s": round(self.answers / s, 2), "tokens_per_s": round(self.tokens / s, 1)}


def stop_ids(model, tok) -> set[int]:
    return set(TargetInfo.of_model(model, tok).eos_ids)


def forward_kwargs(model, cache) -> dict:
    """The cache keyword of this transformers version (`cache` in 5.2x, `past_key_values` before) and logits_to_keep."""
    params = inspect.signature(model.forward).parameters
    kw = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in params:
        kw["logits_to_keep"] = 1
    return kw


def select_rows(cache, keep: torch.Tensor) -> bool:
    """Keep only rows `keep` of a static cache, in place; False when this cache type cannot be cut."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "keys") and layer.keys is not None for layer in layers):
        return False
    for layer in layers:
        layer.keys, layer.values = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)
        if hasattr(layer, "batch_size"):
            layer.batch_size = len(keep)
    return True


@contextlib.contextmanager
def grouped_decode():
    """While active, transformers' "sdpa" attention runs one-token steps of a GQA model as one SDPA call per K/V head,
    its query heads as rows (query head h uses K/V head h // groups, as repeat_kv pairs them); everything else goes
    to the original function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    orig = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        B, H, q, D = query.shape
        KV, L = key.shape[1], key.shape[2]
        plain = attention_mask is not None and attention_mask.dtype != torch.bool
        if q != 1 or KV == H or dropout or plain or kw.get("position_bias") is not None or kw.get("output_attentions"):
            return orig(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
        g = H // KV
        mask = None if attention_mask is None else attention_mask.expand(B, 1, g, L)
        out = F.scaled_dot_product_attention(query.reshape(B, KV, g, D), key, value, attn_mask=mask, scale=scaling)
        return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attend
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = orig


@torch.inference_mode()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, stops: set[int], pad_id: int) -> list[list[int]]:
    """Greedy answers to a batch of prompt ids, each cut after its first stop token (kept) or at max_new_tokens."""
    from transformers import StaticCache

    dev, B, P = model.device, len(prompts), max(len(p) for p in prompts)
    x = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.ones((B, P + max_new_tokens), dtype=torch.long)
    for r, ids in enumerate(prompts):
        x[r, P - len(ids):] = torch.tensor(ids)
        mask[r, : P - len(ids)] = 0
    x, mask = x.to(dev), mask.to(dev)
    pos = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)
    cache = StaticCache(config=model.config, max_cache_len=P + max_new_tokens)
    kw = forward_kwargs(model, cache)
    tok = model(input_ids=x, attention_mask=mask[:, :P], position_ids=pos, **kw).logits[:, -1].argmax(-1)
    stop_t = torch.tensor(sorted(stops) or [-1], device=dev)
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    out[:, 0] = tok
    rows, nxt, done = torch.arange(B, device=dev), pos[:, -1] + 1, torch.isin(tok, stop_t)
    for t in range(1, max_new_tokens):
        if t % CHECK == 0:
            n_done = int(done.sum())
            if n_done == len(rows):
                break
            if n_done >= COMPACT * len(rows) and select_rows(cache, (~done).nonzero().squeeze(1)):
                keep = ~done
                rows, tok, nxt, mask, done = rows[keep], tok[keep], nxt[keep], mask[keep], done[keep]
        with grouped_decode():
            logits = model(input_ids=tok[:, None], attention_mask=mask[:, : P + t], position_ids=nxt[:, None], **kw).logits
        tok = torch.where(done, pad_id, logits[:, -1].argmax(-1))
        out[rows, t] = tok
        done |= torch.isin(tok, stop_t)
        nxt = nxt + 1
    return [cut(row, stops) for row in out.tolist()]


def cut(row: list[int], stops: set[int]) -> list[int]:
    """A row up to and including its first stop token."""
    return next((row[: i + 1] for i, t in enumerate(row) if t in stops), row)


def answer(model, prompts: list[list[int]], max_new_tokens: int, stops: set[int], pad_id: int) -> list[list[int]]:
    """greedy_batch, halving a batch that runs out of GPU memory (the answers do not depend on the batch)."""
    try:
        return greedy_batch(model, prompts, max_new_tokens, stops, pad_id)
    except torch.OutOfMemoryError:
        if len(prompts) == 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = len(prompts) // 2
    return (answer(model, prompts[:half], max_new_tokens, stops, pad_id)
            + answer(model, prompts[half:], max_new_tokens, stops, pad_id))


def encode(tok, prompts: list[Prompt]) -> list[list[int]]:
    """Chat-template ids of every prompt."""
    return [encode_chat(tok, p.messages()) for p in prompts]


def batches(pending: list[tuple[Prompt, list[int]]], size: int, pool: int = POOL) -> Iterable[list[tuple[Prompt, list[int]]]]:
    """Batches of prompts of similar token count: the prompts in a fixed pseudo-random order (by key) cut into pools
    of `pool` batches, each pool sorted longest first. A run cut off by its deadline has then answered a random
    sample of the prompts (not only the longest, which are mostly code), and a batch still pads little."""
    def order(e: tuple[Prompt, list[int]]) -> str:
        p = e[0]
        return prompt_key(p.category + "\0" + p.text + ("\0" + item_key(p) if p.context else ""))
    mixed = sorted(pending, key=order)
    for k in range(0, len(mixed), size * pool):
        part = sorted(mixed[k : k + size * pool], key=lambda e: -len(e[1]))
        for j in range(0, len(part), size):
            yield part[j : j + size]


def generate_into(store: AnswerStore, model, tok, prompts: list[Prompt], max_new_tokens: int, batch_size: int,
                  max_prompt_tokens: int, deadline: float | None = None, quiet: bool = False,
                  on_batch: Callable[[GenStats], None] | None = None) -> GenStats:
    """Answer every prompt not yet in `store`, batch by batch, until `deadline` (time.time()); returns the counts."""
    t0 = time.time()
    have, pending_keys = store.keys(), {}
    for p in prompts:                              # each prompt once, the first of equal texts
        pending_keys.setdefault(item_key(p), p)
    todo = [p for k, p in pending_keys.items() if k not in have]
    st = GenStats(already=len(pending_keys) - len(todo))
    stops = stop_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(stops) if stops else 0)
    enc = list(zip(todo, encode(tok, todo)))
    st.encode_seconds = time.time() - t0
    long = [p for p, ids in enc if len(ids) > max_prompt_tokens]
    store.append([Row(item_key(p), [], 0, p.category) for p in long])
    st.skipped = len(long)
    pending = [(p, ids) for p, ids in enc if len(ids) <= max_prompt_tokens]
    bar = tqdm(total=len(pending), desc="generate", unit="answer", disable=quiet)
    done = 0
    for chunk in batches(pending, batch_size):
        if deadline is not None and time.time() > deadline:
            break
        answers = answer(model, [ids for _, ids in chunk], max_new_tokens, stops, pad)
        store.append([Row(item_key(p), ids + a, len(ids), p.category) for (p, ids), a in zip(chunk, answers)])
        done += len(chunk)
        st.answers += len(chunk)
        st.tokens += sum(map(len, answers))
        st.seconds = time.time() - t0
        bar.update(len(chunk))
        if on_batch is not None:
            on_batch(st)
    bar.close()
    st.pending, st.seconds = len(pending) - done, time.time() - t0
    return st
