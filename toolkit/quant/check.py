"""Step 5: compare each EXL3 drafter with the BF16 reference on held-out prompts (same target hidden states).

Per bitrate: KL(BF16 || EXL3) of the draft logits and top-1 agreement, per block position, and τ with the
target. tap_shift is verified first: the reference's top-1 agreement with the target's own greedy tokens at
each candidate shift; the best one is used everywhere after.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..dflash import DFlashConfig, DFlashDraft
from ..core.errors import ToolkitError
from ..core.tensorfiles import iter_tensors
from .blocks import Prompt, blocks, draft_logits, with_shift
from .recipe import Thresholds
from .validate import linear_keys


@dataclass
class Metrics:
    kl_per_position: list[float] = field(default_factory=list)
    top1_per_position: list[float] = field(default_factory=list)
    tau: float | None = None

    @property
    def kl(self) -> float | None:
        return sum(self.kl_per_position) / len(self.kl_per_position) if self.kl_per_position else None

    @property
    def top1(self) -> float | None:
        return sum(self.top1_per_position) / len(self.top1_per_position) if self.top1_per_position else None


def kl_top1(ref: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [P, V]: KL(softmax(ref) || softmax(q)) and whether the argmaxes agree."""
    lp, lq = F.log_softmax(ref.float(), -1), F.log_softmax(q.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    return kl, (ref.argmax(-1) == q.argmax(-1)).float()


def compare(reference: DFlashDraft, quantized: DFlashDraft, prompts: list[Prompt], target, anchors: int,
            tap_shift: int) -> Metrics:
    """Mean KL and top-1 agreement per drafted position over every anchor of every prompt."""
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    kl_sum = top_sum = None
    count = 0
    for prompt in prompts:
        for _, noise, ctx, pos in blocks(prompt, reference, emb, anchors, tap_shift):
            r = draft_logits(reference, head, noise, ctx, pos)
            q = draft_logits(quantized, head, noise.to(next(quantized.parameters()).dtype), ctx, pos)
            kl, top = kl_top1(r, q)
            kl_sum = kl if kl_sum is None else kl_sum + kl
            top_sum = top if top_sum is None else top_sum + top
            count += 1
    if not count:
        raise ToolkitError("check: the held-out prompts gave no draft blocks (prompts too short?)")
    return Metrics((kl_sum / count).tolist(), (top_sum / count).tolist())


def target_agreement(drafter: DFlashDraft, prompts: list[Prompt], target, anchors: int, tap_shift: int) -> float:
    """How often the drafter's top-1 matches the target's greedy token at each drafted position."""
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    hits = total = 0
    for prompt in prompts:
        n = prompt.ids.numel()
        for a, noise, ctx, pos in blocks(prompt, drafter, emb, anchors, tap_shift):
            logits = draft_logits(drafter, head, noise, ctx, pos)
            for j in range(logits.shape[0]):          # drafted position j+1 predicts token a+j+1
                if a + j < n:
                    hits += int(logits[j].argmax().item() == prompt.greedy[a + j].item())
                    total += 1
    return hits / total if total else 0.0


def pick_tap_shift(drafter: DFlashDraft, prompts: list[Prompt], target, anchors: int,
                   candidates: list[int]) -> tuple[int, dict[int, float]]:
    """The candidate tap_shift with the best agreement with the target (ties: the configured one)."""
    scores = {s: target_agreement(drafter, prompts, target, anchors, s) for s in candidates}
    best = max(scores, key=lambda s: (scores[s], s == drafter.config.tap_shift))
    return best, scores


def measure_tau(target, tokenizer, drafter: DFlashDraft, prompt_ids: list[list[int]], max_new_tokens: int,
                tap_shift: int) -> float:
    """τ (tokens per speculative round) of greedy decoding through the runtime at the drafter's native block (every
    round drafts: the auto policy would decode AR where drafting does not pay), all prompts pooled."""
    from ..runtime.backend import GenSettings
    from ..runtime.events import summarize
    from ..runtime.torch_backend import TorchBackend

    d = copy.copy(drafter)
    d.config = with_shift(drafter.config, tap_shift)
    backend = TorchBackend(target, tokenizer, d)
    rounds = []
    for ids in prompt_ids:
        rounds += list(backend.generate(ids, GenSettings(max_new_tokens=max_new_tokens, temperature=0.0,
                                                         block_size=None)))
    return summarize(rounds).tau


def _dense_from_exllamav3(folder: Path, device: str) -> dict[str, torch.Tensor]:
    """Dequantized [out, in] weights of every EXL3 Linear, through exllamav3's own loader (needs CUDA)."""
    if not torch.cuda.is_available():
        raise ToolkitError(f"check: {folder} holds EXL3 tensors; loading them needs a CUDA GPU (or pass --no-check)")
    from ..exl3 import seams

    seams.require()
    Linear = seams.get("Linear")
    config = seams.get("Config").from_directory(str(folder))
    model = seams.get("Model").from_config(config)
    model.load(device if device.startswith("cuda") else "cuda:0")
    try:
        seams.check_loaded(model)
        return {m.key: m.inner.get_weight_tensor().T.float().contiguous()
                for m in model if isinstance(m, Linear) and m.inner is not None}
    finally:
        model.unload()


def load_quantized(folder: Path, config: DFlashConfig, device: str = "cpu") -> DFlashDraft:
    """The converted drafter as a reference module: 16-bit Linears as stored, EXL3 ones dequantized by exllamav3."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        for k, t in iter_tensors(f, "check"):
            tensors[k.removeprefix("model.")] = t
    need_exl3 = [k for k in linear_keys(config) if f"{k}.weight" not in tensors]
    if need_exl3:
        dense = _dense_from_exllamav3(folder, device)
        for k in need_exl3:
            if k not in dense:
                raise ToolkitError(f"check: {folder} has no tensor for Linear {k!r}")
            tensors[f"{k}.weight"] = dense[k]
    model = DFlashDraft.skeleton(config)
    state = {}
    for name, p in model.state_dict().items():
        if name not in tensors:
            raise ToolkitError(f"check: {folder} has no tensor {name!r}")
        t = tensors[name]
        if t.dim() == 2 and p.dim() == 2 and t.shape != p.shape:      # exllamav3 pads Linears to 128
            t = t[: p.shape[0], : p.shape[1]]
        if t.numel() != p.numel():
            raise ToolkitError(f"check: {folder} tensor {name!r} has shape {list(t.shape)}, expected {list(p.shape)}")
        state[name] = t.reshape(p.shape).float().contiguous()      # its own storage: assigned, not copied
    model.load_state_dict(state, assign=True)
    if "mask_embedding" in tensors:
        model.mask_embedding = torch.nn.Parameter(tensors["mask_embedding"].reshape(-1).float())
    return model.to(device).eval()


def judge(m: Metrics, t: Thresholds, bf16_tau: float | None) -> tuple[bool, list[str]]:
    """Pass unless a measured metric misses the recipe's floor; the misses as short phrases."""
    fails = []
    if t.min_top1 is not None and m.top1 is not None and m.top1 < t.min_top1:
        fails.append(f"top-1 {m.top1:.4f} < {t.min_top1}")
    if t.max_kl is not None and m.kl is not None and m.kl > t.max_kl:
        fails.append(f"KL {m.kl:.4f} > {t.max_kl}")
    if t.min_tau_ratio is not None and m.tau is not None and bf16_tau:
        if m.tau / bf16_tau < t.min_tau_ratio:
            fails.append(f"tau {m.tau:.3f} < {t.min_tau_ratio} x BF16 tau {bf16_tau:.3f}")
    return not fails, fails
