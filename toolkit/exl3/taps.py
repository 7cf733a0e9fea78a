"""An EXL3 target as the quantize pipeline needs it, on exllamav3: greedy continuations, the hidden
states at the drafter's taps, the embedding table and the LM head.

The taps come out the way exllamav3's own DFlash path gets them. A DFlash drafter sets
`draft_verifier_params = {"export_state_layers": {L + tap_shift, ...}}`; the generator passes those params to
the target's forward, and every TransformerBlock whose `layer_idx` is in the set appends its output (fp16,
[bsz, seq, hidden], in layer order) to `params["export_states"]` (modules/transformer.py). We pass the same
key to one plain no-cache forward (`attn_mode="flash_attn_nc"`) over a whole prompt, so a tap is the very
tensor exllamav3's drafter reads: the output of target layer L + s, HF `hidden_states[L + s + 1]`, the
toolkit's tap convention. Greedy continuations run exllamav3's Generator through the exllamav3 backend
(exl3/backend.py) with no drafter. Those two params keys and `Model.logit_layer_idx` are what this module
relies on; the seam check (exl3/seams.py) refuses an exllamav3 without them in one line.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..core.errors import ToolkitError
from ..runtime.backend import GenSettings
from . import seams

EXPORT_LAYERS = "export_state_layers"    # params key: the layer indices whose outputs a forward exports
EXPORTED = "export_states"               # params key: the exported outputs, in layer order
EMBED_CHUNK = 16384                      # vocabulary rows per embedding lookup when the table is read out
HEAD_ROWS = 128                          # identity rows per pass through the LM head (exllamav3 reconstructs above 144)


STATEFUL_SCAN = os.environ.get("DFLASH_STATELESS_SCAN", "") != "1"   # "1": the no-cache forward as exllamav3 runs it


@contextmanager
def stateful_scan() -> Iterator[None]:
    """Within it, exllamav3's gated delta rule gets a zero initial state (fp32, as a cache hands its state over)
    where it has none, and its final state is dropped where none was asked for: the same result (the state starts
    at zero either way) through the kernel build a cached prefill uses. Without it the no-cache forward makes Triton
    autotune and compile a second build of the state kernel, about 23 s on a fresh machine."""
    inner = seams.get("chunk_gated_delta_rule")            # exllamav3's vendored gated delta rule (Qwen3.6)
    if inner is None or not STATEFUL_SCAN:
        yield
        return

    def scan(q, k, v, *a, initial_state=None, output_final_state=False, **kw):
        if initial_state is not None:
            return inner(q, k, v, *a, initial_state=initial_state, output_final_state=output_final_state, **kw)
        zero = torch.zeros((q.shape[0], v.shape[2], k.shape[3], v.shape[3]), dtype=torch.float32, device=q.device)
        o, state = inner(q, k, v, *a, initial_state=zero, output_final_state=True, **kw)
        return o, (state if output_final_state else None)

    with seams.swapped("chunk_gated_delta_rule", scan):
        yield


def check_installed() -> None:
    """exllamav3 installed (one line otherwise); its seams are checked when it loads."""
    seams.installed()


def free_gpu() -> None:
    """Give cached GPU memory back after a model is unloaded."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Exl3Target:
    """A loaded EXL3 target (an Exl3Backend without drafter) with the calls the quantize pipeline makes."""

    def __init__(self, backend, batch: int = 8):
        self.backend = backend
        self.model = backend.model
        seams.check_instance("Config", self.model.config)
        self.batch = max(1, batch)
        self.vocab_size = int(self.model.config.vocab_size)
        self.hidden_size = int(self.model.config.hidden_size)

    def continue_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Each prompt followed by the target's greedy continuation (up to max_new_tokens, stopping at EOS)."""
        settings = GenSettings(max_new_tokens=max_new_tokens, temperature=0.0, block_size=None)
        out = [list(p) for p in prompts]
        for k in range(0, len(prompts), self.batch):
            for i, r in self.backend.generate_many([list(p) for p in prompts[k:k + self.batch]], settings,
                                                   speculative=False):
                out[k + i] += r.tokens
        return out

    def forward(self, ids: list[int], layers: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One no-cache forward: the greedy next token per position [n] and the output of each of `layers`
        [1, n, hidden] (fp16), both on the CPU."""
        want = sorted(set(layers))
        params = {"attn_mode": "flash_attn_nc", EXPORT_LAYERS: set(want)}
        with stateful_scan():
            logits = self.model.forward(torch.tensor([list(ids)], dtype=torch.long), params)
        states = params.get(EXPORTED) or []
        if len(states) != len(want):
            raise ToolkitError(f"exllamav3 exported {len(states)} hidden states for the {len(want)} tap layers {want}; "
                               f"the tap capture is tested with exllamav3 {seams.TESTED}")
        greedy = logits[0, :, : self.vocab_size].argmax(-1).cpu()
        return greedy, {L: s.cpu() for L, s in zip(want, states)}

    def embedding_table(self) -> torch.Tensor:
        """The token embedding table [vocab, hidden] (float32, CPU), read through exllamav3's own lookup, so a
        streamed or quantized table reads the same as a resident one."""
        Embedding = seams.get("Embedding")
        emb = next((m for m in self.model.modules if isinstance(m, Embedding)), None)
        if emb is None:
            raise ToolkitError("exllamav3 model has no Embedding module: not a text target")
        rows = []
        with torch.inference_mode():
            for k in range(0, self.vocab_size, EMBED_CHUNK):
                ids = torch.arange(k, min(self.vocab_size, k + EMBED_CHUNK), dtype=torch.long)[None]
                rows.append(emb.forward(ids, {}).float()[0, :, : self.hidden_size].cpu())
        return torch.cat(rows)

    def head_weight(self) -> torch.Tensor:
        """The LM head [vocab, hidden] as exllamav3 computes with it, fp16 on the CPU: rows of the identity through
        the head's own kernel, HEAD_ROWS at a time. exllamav3's get_weight_tensor would dequantize the whole
        head at once in float32 (about 6 GiB for Qwen3.6's 248k x 2048)."""
        lm = self.model.modules[self.model.logit_layer_idx]
        n_in = int(lm.inner.in_features)
        dev = lm.device
        rows = []
        with torch.inference_mode():
            for k in range(0, self.hidden_size, HEAD_ROWS):
                eye = torch.zeros((min(HEAD_ROWS, self.hidden_size - k), n_in), dtype=torch.half, device=dev)
                eye[:, k: k + eye.shape[0]].fill_diagonal_(1.0)
                out = lm.inner.forward(eye, {}, out_dtype=torch.float)      # [rows, out]: W's rows k..
                rows.append(out[:, : self.vocab_size].half().cpu())
        return torch.cat(rows).T.contiguous()

    def close(self) -> None:
        self.backend.close()
        free_gpu()


def open_target(folder: str | Path, cache_tokens: int, max_concurrency: int, split=None,
                max_chunk: int | None = None) -> Exl3Target:
    """Load an EXL3 target folder alone (no drafter) through the exllamav3 backend (`split`: its GPUs, None = GPU 0;
    `max_chunk`: the longest sequence it will forward, rounded up to 256, which its load measures)."""
    from ..runtime.factory import load_backend

    check_installed()
    backend = load_backend("exllamav3", folder, None, cache_tokens=cache_tokens, max_concurrency=max_concurrency,
                           split=split, max_chunk=max_chunk)
    return Exl3Target(backend, batch=max_concurrency)
