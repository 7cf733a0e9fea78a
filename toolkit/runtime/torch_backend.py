"""The torch backend: any transformers causal LM as target, the reference DFlash module as drafter.

It is the CPU reference that the exllamav3 backend is checked against. Rollback after a rejection crops
the target's KV cache; a target with recurrent layers (Qwen3.5/3.6 Gated DeltaNet) cannot be cropped,
so its cache is snapshotted before each verify and the accepted tokens are replayed from the snapshot.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Iterator

import torch

from ..dflash import DFlashConfig, DFlashDraft, DraftCache, gather_taps, load_drafter
from ..core.errors import ToolkitError
from ..core.target import TargetInfo
from .backend import Backend, GenSettings
from .events import Round
from .loop import decode
from .sampling import Sampler


class TorchSteps:
    """Prefill / draft / verify / accept for one sequence on a transformers target."""

    def __init__(self, target, drafter: DFlashDraft | None):
        from transformers import DynamicCache

        self.target, self.drafter = target, drafter
        self.cache = DynamicCache(config=target.config)
        self.cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        types = getattr(target.config, "layer_types", None) or []
        self.recurrent = any(t not in ("full_attention", "sliding_attention") for t in types)
        self.draft_cache = DraftCache(drafter) if drafter is not None else None
        self.pos = 0
        self._pending: tuple[list[int], torch.Tensor | None] | None = None
        self._snapshot = None

    def _forward(self, ids: list[int]):
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        return self.target(input_ids=x, use_cache=True, output_hidden_states=self.drafter is not None, **{self.cache_arg: self.cache})

    def _taps(self, out) -> torch.Tensor | None:
        return gather_taps(out.hidden_states, self.drafter.config) if self.drafter is not None else None

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        out = self._forward(prompt_ids)
        self.pos = len(prompt_ids)
        if self.drafter is not None:
            self.drafter.extend(self.draft_cache, self._taps(out))
        return out.logits[0, -1]

    @torch.no_grad()
    def draft_block(self, token: int, width: int) -> list[int]:
        emb = self.target.get_input_embeddings().weight
        h = self.drafter.draft_hidden(self.draft_cache, torch.tensor([token], device=emb.device), emb)
        logits = self.target.get_output_embeddings()(h[:, 1 : 1 + width].to(emb.dtype))
        return logits[0].argmax(-1).tolist()

    @torch.no_grad()
    def verify(self, block: list[int]) -> torch.Tensor:
        self._snapshot = copy.deepcopy(self.cache) if self.recurrent and len(block) > 1 else None
        out = self._forward(block)
        self._pending = (block, self._taps(out))
        return out.logits[0]

    @torch.no_grad()
    def accept(self, n: int) -> None:
        block, taps = self._pending
        if n < len(block):
            if self._snapshot is not None:          # recurrent state: restore and replay the kept tokens
                self.cache = self._snapshot
                self._forward(block[:n])
            else:
                self.cache.crop(-(len(block) - n))   # negative = tokens to drop, in transformers 4.x and 5.x
        self.pos += n
        if self.drafter is not None:
            self.drafter.extend(self.draft_cache, taps[:, :n])
        self._pending = self._snapshot = None


def load_hf_model(folder: str | Path, device: str = "cpu", dtype="auto", what: str = "--target"):
    """A transformers causal LM from a local folder, on `device`, in eval mode with its weights frozen.

    Strict: an EXL3 checkpoint or a DFlash drafter is refused by its kind, every safetensors header is checked
    against its file (truncation), and any tensor transformers' loading report lists as missing, unexpected or
    misshaped is one line naming it: never a model running on randomly initialised weights."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from ..core.kinds import HF, check_loading, require
    from ..core.tensorfiles import check_folder

    require(folder, HF, what)
    check_folder(folder, what)
    try:
        model, report = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True,
                                                            ignore_mismatched_sizes=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolkitError(f"{what}: cannot load {folder} with transformers ({reason})") from None
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    check_loading(report, folder, what, tied)
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError, ValueError) as e:       # no CUDA build, no such GPU, a bad device string
        raise ToolkitError(f"--device {device}: cannot place the model there ({str(e).splitlines()[0]})") from None
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_hf_tokenizer(folder: str | Path, what: str = "--target"):
    """The folder's transformers tokenizer; a folder without one, or a broken one, is one line."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolkitError(f"{what}: cannot load the tokenizer of {folder} ({reason})") from None


class TorchBackend(Backend):
    """Backend over a transformers target and an optional reference drafter."""

    name = "torch"

    def __init__(self, target, tokenizer, drafter: DFlashDraft | None = None):
        self.target, self.tokenizer, self.drafter = target.eval(), tokenizer, drafter
        info = TargetInfo.of_model(target, tokenizer)
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.max_context, self.eos_ids = info.max_context, info.eos_ids

    @classmethod
    def from_dirs(cls, target: str | Path, draft: str | Path | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> "TorchBackend":
        """Load a local target folder (transformers) and drafter folder (upstream layout), checked against each other."""
        info = TargetInfo.read(target, "target")
        drafter = None
        if draft is not None:
            DFlashConfig.from_dir(draft).validate_against(info.config)
            drafter = load_drafter(draft, dtype=dtype, device=device)
        return cls(load_hf_model(target, device, dtype), load_hf_tokenizer(target), drafter)

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        self.check_prompts([prompt_ids], settings.max_new_tokens)
        width = self.draft_width(settings, speculative)
        steps = TorchSteps(self.target, self.drafter if width else None)
        sampler = Sampler(settings.temperature, settings.seed)
        yield from decode(steps, list(prompt_ids), settings.max_new_tokens, sampler, set(self.stop_ids(settings)), width)
