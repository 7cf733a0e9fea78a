"""The Qwen3.5 / Qwen3.6 MTP head in PyTorch: what the torch backend drafts with under `--draft mtp`, the CPU
reference of exllamav3's own MTP drafter.

A row at position p takes the embedding of the token at p and a hidden state: the target's final (normed) hidden
state at p - 1, or, for the second and later draft steps of a round, the head's own output at p - 1. Both are
RMS-normed (Qwen3.5 norms scale by 1 + weight), concatenated [embedding, hidden] and projected 2H -> H by `fc`,
then run through the head's decoder layer(s): gated attention (the query projection also carries a sigmoid gate
on the output, per head) over the head's own K/V cache with the target's partial RoPE at position p, then the MoE
block (routed experts plus a sigmoid-gated shared expert) or the dense MLP. `mtp.norm` closes it, and the target's
LM head turns the result into the next token's logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import ToolkitError
from ..core.tensorfiles import iter_tensors
from .config import PREFIX, MtpShape, hf_tensors


class Norm(nn.Module):
    """RMSNorm that scales by 1 + weight (weights stored centred on 0, as Qwen3.5 stores them)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class MtpCache:
    """The head's K/V, per layer [kv heads, positions, head dim] (keys after RoPE); rows 0..length-1 are valid."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[1]

    def crop(self, n: int) -> None:
        """Keep rows 0..n-1."""
        self.k = [None if t is None else t[:, :n] for t in self.k]
        self.v = [None if t is None else t[:, :n] for t in self.v]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first cos.shape[-1] dims of the last axis, the rest passed through."""
    r = cos.shape[-1]
    a, rest = x[..., :r], x[..., r:]
    half = torch.cat((-a[..., r // 2:], a[..., : r // 2]), -1)
    return torch.cat((a * cos + half * sin, rest), -1)


class Attention(nn.Module):
    def __init__(self, s: MtpShape):
        super().__init__()
        H, hd = s.hidden_size, s.head_dim
        self.heads, self.kv_heads, self.hd = s.heads, s.kv_heads, hd
        self.q_proj = nn.Linear(H, 2 * s.heads * hd, bias=False)
        self.k_proj = nn.Linear(H, s.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, s.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(s.heads * hd, H, bias=False)
        self.q_norm, self.k_norm = Norm(hd, s.rms_norm_eps), Norm(hd, s.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: MtpCache, layer: int) -> torch.Tensor:
        n = x.shape[0]
        q, gate = self.q_proj(x).view(n, self.heads, 2 * self.hd).chunk(2, -1)
        q = rotate(self.q_norm(q), cos[:, None], sin[:, None]).transpose(0, 1)          # [heads, n, hd]
        k = rotate(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.hd)), cos[:, None], sin[:, None]).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.hd).transpose(0, 1)
        start = cache.length
        if cache.k[layer] is not None:
            k, v = torch.cat((cache.k[layer], k), 1), torch.cat((cache.v[layer], v), 1)
        cache.k[layer], cache.v[layer] = k, v
        rep = self.heads // self.kv_heads
        keys = torch.arange(k.shape[1], device=x.device)
        mask = keys[None, :] <= (start + torch.arange(n, device=x.device))[:, None]      # causal over absolute positions
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask)
        out = out.transpose(0, 1).reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)


class Mlp(nn.Module):
    def __init__(self, H: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Moe(nn.Module):
    """Routed experts (softmax router, top k, weights renormalised) plus a shared expert behind a sigmoid gate."""

    def __init__(self, s: MtpShape):
        super().__init__()
        E, H, inter = s.experts, s.hidden_size, s.moe_intermediate
        self.top_k = s.experts_per_tok
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate, self.w_up = nn.Parameter(torch.zeros(E, inter, H)), nn.Parameter(torch.zeros(E, inter, H))
        self.w_down = nn.Parameter(torch.zeros(E, H, inter))
        self.shared_expert = Mlp(H, s.shared_intermediate)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), -1)
        weight, chosen = torch.topk(probs, self.top_k, -1)
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            h = x[rows]
            y = F.linear(F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e])
            out.index_add_(0, rows, y * weight[rows, slot, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Layer(nn.Module):
    def __init__(self, s: MtpShape):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(s.hidden_size, s.rms_norm_eps), Norm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.mlp = Moe(s) if s.experts else Mlp(s.hidden_size, s.intermediate)

    def forward(self, x, cos, sin, cache: MtpCache, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpHead(nn.Module):
    """The head's own weights (no embedding or LM head: those are the target's)."""

    def __init__(self, shape: MtpShape):
        super().__init__()
        H = shape.hidden_size
        self.shape = shape
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = Norm(H, shape.rms_norm_eps), Norm(H, shape.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(Layer(shape) for _ in range(shape.layers))
        self.norm = Norm(H, shape.rms_norm_eps)
        rot = int(shape.head_dim * shape.rotary_factor) // 2 * 2
        self.register_buffer("inv_freq", 1.0 / shape.rope_theta ** (torch.arange(0, rot, 2).float() / rot), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: MtpCache) -> torch.Tensor:
        """Rows for `embeds` [n, H] (the tokens' embeddings) and `hidden` [n, H] (the state before each) at positions
        cache.length.. (appended to the cache); returns the head's normed output [n, H]."""
        pos = torch.arange(cache.length, cache.length + embeds.shape[0], device=embeds.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat((freqs, freqs), -1).cos().to(embeds.dtype), torch.cat((freqs, freqs), -1).sin().to(embeds.dtype)
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))), -1))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i)
        return self.norm(x)


def head_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """The `mtp.` tensors of a model folder's safetensors files (only those are read)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(iter_tensors(f, "--target", prefix=PREFIX))
    return out


def fuse_experts(t: dict[str, torch.Tensor], shape: MtpShape) -> dict[str, torch.Tensor]:
    """Experts one by one -> the head's stacked parameters (a fused checkpoint's gate_up_proj / down_proj split)."""
    out = dict(t)
    for i in range(shape.layers if shape.experts else 0):
        m = f"{PREFIX}layers.{i}.mlp"
        if f"{m}.experts.gate_up_proj" in out:
            gu = out.pop(f"{m}.experts.gate_up_proj")
            out[f"{m}.w_gate"], out[f"{m}.w_up"] = gu[:, : shape.moe_intermediate], gu[:, shape.moe_intermediate:]
            out[f"{m}.w_down"] = out.pop(f"{m}.experts.down_proj")
            continue
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            keys = [f"{m}.experts.{e}.{theirs}.weight" for e in range(shape.experts)]
            if all(k in out for k in keys):
                out[f"{m}.{ours}"] = torch.stack([out.pop(k) for k in keys])
    return out


def load_head(folder: str | Path, shape: MtpShape, dtype: torch.dtype = torch.float32, device: str = "cpu") -> MtpHead:
    """The head of the target in `folder`, strict: a missing, misshaped or unknown `mtp.` tensor is one line."""
    found = head_tensors(folder)
    want = hf_tensors(shape)
    fused = {k for k in found if ".experts.gate_up_proj" in k or ".experts.down_proj" in k}
    for name, dims in want.items():
        expert = ".experts." in name and name.rsplit(".experts.", 1)[0] + ".experts.gate_up_proj" in fused
        if name not in found and not expert:
            raise ToolkitError(f"--target: {folder} lacks MTP tensor {name!r}; refusing to draft with random weights")
        if name in found and tuple(found[name].shape) != dims:
            raise ToolkitError(f"--target: {folder}: MTP tensor {name!r} has shape {tuple(found[name].shape)}, the config "
                               f"needs {dims}")
    head = MtpHead(shape)
    state = {k.removeprefix(PREFIX): v for k, v in fuse_experts(found, shape).items()}
    extra = sorted(set(state) - set(head.state_dict()))
    if extra:
        raise ToolkitError(f"--target: {folder} has MTP tensor {PREFIX + extra[0]!r}, which the head does not use")
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ToolkitError(f"--target: {folder}: its MTP tensors do not fit the head ({str(e).splitlines()[0]})") from None
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
