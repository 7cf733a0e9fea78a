"""The torch backend drafting with the target's own MTP head (`--draft mtp`): the CPU reference of exllamav3's MTP
drafting, through the same speculative loop (runtime/loop.py) and the same `Round`s as the DFlash drafter.

The head keeps a K/V cache of its own, one row per position. The row of position p pairs the token at p with the
target's final hidden state at p - 1 (zeros for p = 0), so the rows of accepted tokens are written from the
target's own states, in one call before the next draft (tokens a plain AR round of the policy kept wait for it
too). A round then drafts step by step: the row of the round's first token gives the first draft, and each next
step pairs the draft just made with the head's own output; those speculative rows are dropped after the round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..costs.table import CostTable
from ..mtp import DEPTH, MTP
from ..mtp.head import MtpCache, MtpHead, load_head
from .hf import load_hf_model, load_hf_tokenizer
from .pair import ModelPair
from .torch_backend import BACKLOG_MAX, TapHooks, TorchBackend, TorchSteps


class MtpSteps(TorchSteps):
    """Prefill / draft / verify / accept for one sequence, the target's MTP head as the drafter (None: plain AR)."""

    def __init__(self, target, head: MtpHead | None):
        super().__init__(target, None)
        self.head = head
        if head is None:
            return
        self.taps = [len(target.get_decoder().layers)]     # hidden_states[num_layers]: the final norm's output
        self.hooks = TapHooks.of(target, self.taps)
        self.mtp_cache = MtpCache(head.shape.layers)
        self.ids: list[int] = []                            # the tokens in the target's cache, in order
        self.states: list[torch.Tensor] = []                # final states of positions `base`.. (not yet all used)
        self.base = 0

    def _forward(self, ids: list[int], capture: bool = False):
        if not capture or self.head is None:
            return super()._forward(ids)
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        kw = {self.cache_arg: self.cache}
        if self.hooks is not None:
            return self.hooks.forward(lambda: self.target(input_ids=x, use_cache=True, **kw), self.taps)
        out = self.target(input_ids=x, use_cache=True, output_hidden_states=True, **kw)
        return out, [out.hidden_states[-1]]

    def _keep(self, taps: list[torch.Tensor] | None) -> None:
        """Keep the final states of the tokens the target's cache kept; write the head's rows of a long backlog."""
        if self.head is None or taps is None or taps[0].shape[1] == 0:
            return
        self.states.append(taps[0][0])
        if len(self.ids) - self.mtp_cache.length >= BACKLOG_MAX:
            self._rows(self.ids[self.mtp_cache.length:])

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        if self.head is not None:
            self.ids += list(prompt_ids)
        return super().prefill(prompt_ids)

    @torch.no_grad()
    def accept(self, n: int) -> None:
        if self.head is not None:
            self.ids += list(self._pending[0][:n])
        super().accept(n)

    def _rows(self, tokens: list[int]) -> torch.Tensor:
        """Write the head's rows of `tokens` at positions mtp_cache.length.. from the target's states before them;
        the head's output at the last one [1, H]."""
        start, emb = self.mtp_cache.length, self.target.get_input_embeddings()
        states = torch.cat(self.states) if len(self.states) > 1 else self.states[0]
        if start == 0:
            prev = torch.cat((torch.zeros_like(states[:1]), states[: len(tokens) - 1]))
        else:
            prev = states[start - 1 - self.base: start - 1 - self.base + len(tokens)]
        out = self.head(emb(torch.tensor(tokens, device=states.device)), prev, self.mtp_cache)
        keep = start + len(tokens) - 1                      # the next row needs the state of this position on
        self.states, self.base = [states[keep - self.base:]], keep
        return out[-1:]

    @torch.no_grad()
    def draft_block(self, token: int, width: int) -> list[int]:
        out = self._rows(self.ids[self.mtp_cache.length:] + [token])
        true, emb, head = self.mtp_cache.length, self.target.get_input_embeddings(), self.target.get_output_embeddings()
        drafts: list[int] = []
        for k in range(width):
            drafts.append(int(head(out.to(emb.weight.dtype))[0].argmax()))
            if k + 1 < width:                               # a speculative row: the draft and the head's own state
                out = self.head(emb(torch.tensor(drafts[-1:], device=out.device)), out, self.mtp_cache)
        self.mtp_cache.crop(true)
        return drafts


class MtpTorchBackend(TorchBackend):
    """The torch backend over a transformers target that carries an MTP head, drafting with that head: its native
    block is DEPTH + 1 (up to DEPTH drafts a round), `--block-size N` drafts N - 1, `auto` lets the policy pick."""

    def __init__(self, target, tokenizer, head: MtpHead, costs: CostTable | None = None,
                 folders: Sequence[str | Path] = ()):
        super().__init__(target, tokenizer, None, costs, folders)
        self.head, self.block_size = head, DEPTH + 1
        self.book.block_size = self.block_size          # the policy picks among the head's widths

    @classmethod
    def from_dirs(cls, target: str | Path, draft: str | Path | None = MTP, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, pair: ModelPair | None = None) -> MtpTorchBackend:
        """Load a local target folder (transformers) and its MTP head, checked to be there (`pair`: already read)."""
        pair = pair or ModelPair.read(target, MTP)
        head = load_head(pair.target, pair.mtp, dtype=dtype, device=device)       # refused before the target loads
        model = load_hf_model(pair.target, device, dtype, info=pair.info)
        return cls(model, load_hf_tokenizer(pair.target), head, folders=pair.folders)

    def steps(self, drafting: bool) -> MtpSteps:
        return MtpSteps(self.target, self.head if drafting else None)
