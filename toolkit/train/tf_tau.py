"""Teacher-forced tau: what greedy speculative decoding would accept on the held-out prompts, from one drafter pass.

For a held-out prompt, the target's greedy answer y_0..y_{N-1} is generated once. Greedy speculative decoding
(runtime/loop.py) starts a round at anchor y_j (j = 0 right after prefill) with the context prompt + y_0..y_j: the
drafter sees the target's taps of the positions before the anchor and drafts d_1..d_{B-1}; the target's own picks
in that context are y_{j+1}, y_{j+2}, ..., so it accepts the longest prefix of the drafts equal to them and emits it
plus its next token; the next round's anchor is j + accepted + 1. So one batched drafter pass over every anchor of
y (taps from one target forward over prompt + y) gives every round of that decode without running it:
accepted_j = min(match_j, b - 1, N - j - 2), the last term being the runtime's clip at the stop token or the token
budget. tau = 1 + mean accepted, pooled over the rounds of a category, as `summarize` computes it. The only
difference from decoding is numerical (one full forward against incremental ones); tests/test_train_scale.py checks
that the rounds are the same on the tiny pair (CPU, fp32). In half precision on a GPU the batched generation and the
speculative verify run other kernels, so at a near-tie a real decode can leave the stored answer and the two part
from there (NVIDIA Model-Optimizer's DFlash PR #1211 calls these "fixed" and "online" ground truth): the estimate
is for choosing checkpoints, and `python -m toolkit.eval_tau` stays the measure that is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dflash import DFlashDraft
from .distill import target_taps
from .objective import chunk_logits, sample_anchors
from .store import Corpus


@dataclass
class EvalSet:
    """Held-out prompts with the target's answers: right-padded ids and their taps on the device."""

    ids: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    categories: list[str]
    taps: torch.Tensor

    def __len__(self) -> int:
        return len(self.categories)


def eval_set(target, corpus: Corpus, config, device: str, dtype: torch.dtype | None = None, batch: int = 16) -> EvalSet:
    """The evaluation set of a corpus of held-out answers (taps computed once: the target is frozen)."""
    ids, lengths, starts = corpus.batch(list(range(len(corpus))), device)
    taps = torch.cat([target_taps(target, ids[k : k + batch], lengths[k : k + batch], config)
                      for k in range(0, len(corpus), batch)])
    return EvalSet(ids, lengths, starts, list(corpus.categories), taps.to(dtype or taps.dtype))


@torch.no_grad()
def matches(model: DFlashDraft, ev: EvalSet, embed: torch.Tensor, head: torch.Tensor, chunk: int = 64) -> list[list[int]]:
    """Per held-out answer, for every anchor j = 0..N-2: how many leading drafts equal the target's next tokens."""
    anchors, valid = sample_anchors(ev.starts, ev.lengths, None)
    out = torch.zeros(anchors.shape, dtype=torch.long)
    for rows, c0, logits, labels, ok in chunk_logits(model, ev.ids, ev.taps, ev.lengths, anchors, valid, embed, head, chunk):
        hit = (logits.argmax(-1) == labels) & ok
        out[rows, c0 : c0 + hit.shape[1]] = hit.long().cumprod(-1).sum(-1).cpu()
    return [out[s, : int(valid[s].sum())].tolist() for s in range(len(ev))]


def walk(match: list[int], answer_len: int, block: int) -> list[int]:
    """The accepted counts of greedy decoding's rounds at block size `block`, given every anchor's match."""
    acc, j = [], 0
    while j <= answer_len - 2:
        a = min(match[j], block - 1, answer_len - j - 2)
        acc.append(a)
        j += a + 1
    return acc


def tf_tau(model: DFlashDraft, ev: EvalSet, embed: torch.Tensor, head: torch.Tensor, block_sizes=(16, 8),
           chunk: int = 64) -> dict:
    """tau per category and block size (as strings, like eval_tau), the round counts, and `score`: the mean over
    categories of tau at the drafter's own block size (what the trainer keeps the best checkpoint by)."""
    was = model.training
    model.eval()
    ms = matches(model, ev, embed, head, chunk)
    model.train(was)
    answer = (ev.lengths - ev.starts).tolist()
    block_sizes = sorted({min(b, model.config.block_size) for b in block_sizes}, reverse=True)
    tau: dict = {}
    rounds: dict = {}
    for cat in sorted(set(ev.categories)):
        rows = [s for s, c in enumerate(ev.categories) if c == cat]
        for b in block_sizes:
            acc = [a for s in rows for a in walk(ms[s], answer[s], b)]
            tau.setdefault(cat, {})[str(b)] = round(1 + sum(acc) / len(acc), 4) if acc else 1.0
            rounds.setdefault(cat, {})[str(b)] = len(acc)
    own = str(model.config.block_size)
    per = [t[own] for t in tau.values() if own in t]
    return {"tau": tau, "rounds": rounds, "score": round(sum(per) / len(per), 4) if per else 0.0}
