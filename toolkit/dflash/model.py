"""The DFlash drafter as a plain PyTorch module, with the upstream weight names.

Context: hidden_norm(fc(concat of the target's hidden states at the taps)), projected to K/V in every layer.
Block: [last token, MASK x (B-1)], embedded with the target's embeddings; it attends to context plus block
and leaves through the target's lm_head. `DraftCache` holds the context K/V and grows with accepted tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.to(torch.promote_types(dt, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NEOX-style rotary embedding of x [b, n, heads, d] at positions pos [b, n]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = pos.to(torch.float64)[..., None] * inv                     # [b, n, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DraftAttention(nn.Module):
    """Q from the block; K/V from context rows plus block rows."""

    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        h, H, KV, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, H * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, KV * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, KV * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.heads, self.kv_heads, self.head_dim, self.theta = H, KV, D, cfg.rope_theta
        self.window = cfg.window(layer)
        self.causal = cfg.block_causal(layer)

    def project_kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of rows x [b, n, h] at positions pos [b, n]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        return rope(k, pos, self.theta), v

    def mask(self, q_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_keep: torch.Tensor | None = None) -> torch.Tensor:
        """Boolean [b, 1, q, ctx+q]: context rows inside the window, block rows per causality."""
        dc = q_pos[:, :, None] - ctx_pos[:, None, :]
        ctx_ok = torch.ones_like(dc, dtype=torch.bool) if self.window is None else dc < self.window
        if ctx_keep is not None:                                  # training: each row sees only its own prefix
            ctx_ok = ctx_ok & ctx_keep[:, None, :]
        db = q_pos[:, :, None] - q_pos[:, None, :]
        blk_ok = db >= 0 if self.causal else torch.ones_like(db, dtype=torch.bool)
        if self.window is not None:
            blk_ok = blk_ok & (db.abs() < self.window)
        return torch.cat([ctx_ok, blk_ok], -1)[:, None]

    def forward(self, x, pos, ctx_k, ctx_v, ctx_pos, ctx_keep=None) -> torch.Tensor:
        b, n, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)), pos, self.theta)
        k_b, v_b = self.project_kv(x, pos)
        k = torch.cat([ctx_k, k_b], 1).transpose(1, 2)
        v = torch.cat([ctx_v, v_b], 1).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=self.mask(pos, ctx_pos, ctx_keep))
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, pos, ctx_k, ctx_v, ctx_pos, ctx_keep=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos, ctx_k, ctx_v, ctx_pos, ctx_keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftCache:
    """Per-layer context K/V of the accepted tokens; sliding layers keep only their window."""

    def __init__(self, drafter: "DFlashDraft", batch: int = 1):
        p = next(drafter.parameters())
        L, KV, D = len(drafter.layers), drafter.config.num_key_value_heads, drafter.config.head_dim
        self.k = [torch.zeros(batch, 0, KV, D, dtype=p.dtype, device=p.device) for _ in range(L)]
        self.v = [torch.zeros(batch, 0, KV, D, dtype=p.dtype, device=p.device) for _ in range(L)]
        self.pos = [torch.zeros(batch, 0, dtype=torch.long, device=p.device) for _ in range(L)]
        self.windows = [layer.self_attn.window for layer in drafter.layers]
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        w = self.windows[layer]
        self.k[layer] = torch.cat([self.k[layer], k], 1)
        self.v[layer] = torch.cat([self.v[layer], v], 1)
        self.pos[layer] = torch.cat([self.pos[layer], pos], 1)
        if w is not None and self.k[layer].shape[1] > w:
            self.k[layer], self.v[layer], self.pos[layer] = (t[:, -w:] for t in (self.k[layer], self.v[layer], self.pos[layer]))


class DFlashDraft(nn.Module):
    """The drafter. It has no embedding or lm_head: callers pass the target's (see `draft`)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mask_embedding: nn.Parameter | None = None   # set by the loader when the checkpoint ships one

    @classmethod
    def skeleton(cls, config: DFlashConfig) -> "DFlashDraft":
        """The drafter with its parameters on the meta device, for a loader to fill with
        load_state_dict(..., assign=True): no random init (3.8 s for the upstream shape on the CPU) and no memory."""
        with torch.device("meta"):
            return cls(config)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """hidden_norm(fc(taps)): the context rows every layer projects to K/V."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self, noise_embeds: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor, ctx_keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stateless forward: block hidden states [b, B, h] for context taps [b, n, T*h] at positions [b, n+B].
        ctx_keep [b, n] (optional, for training) hides context rows a block must not see."""
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(noise_embeds.shape[0], -1)
        n = target_hidden.shape[1]
        ctx, ctx_pos, pos = self.context(target_hidden), position_ids[:, :n], position_ids[:, n:]
        x = noise_embeds
        for layer in self.layers:
            k, v = layer.self_attn.project_kv(ctx, ctx_pos)
            x = layer(x, pos, k, v, ctx_pos, ctx_keep)
        return self.norm(x)

    @torch.no_grad()
    def extend(self, cache: DraftCache, target_hidden: torch.Tensor) -> None:
        """Append context rows for newly accepted tokens (their taps [b, n, T*h]) to the cache."""
        b, n, _ = target_hidden.shape
        pos = torch.arange(cache.length, cache.length + n, device=target_hidden.device)[None].expand(b, -1)
        ctx = self.context(target_hidden.to(self.fc.weight.dtype))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, pos)
            cache.append(i, k, v, pos)
        cache.length += n

    def embed_block(self, tokens: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Embed [b] last tokens followed by B-1 masks with the target's embedding table: [b, B, h]."""
        B = self.config.block_size
        ids = torch.full((tokens.shape[0], B), self.config.mask_token_id, dtype=torch.long, device=tokens.device)
        ids[:, 0] = tokens
        x = F.embedding(ids, embed_weight).to(self.fc.weight.dtype) * self.config.input_embedding_scale
        if self.mask_embedding is not None:
            x[:, 1:] = self.mask_embedding.to(x.dtype)
        return x

    @torch.no_grad()
    def draft_hidden(self, cache: DraftCache, tokens: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Block hidden states [b, B, h] after the cached context, for the block starting with `tokens`."""
        x = self.embed_block(tokens, embed_weight)
        b, B = x.shape[:2]
        pos = torch.arange(cache.length, cache.length + B, device=x.device)[None].expand(b, -1)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, cache.k[i], cache.v[i], cache.pos[i])
        return self.norm(x)


def gather_taps(hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor], config: DFlashConfig) -> torch.Tensor:
    """Concatenate the target's hidden states at the taps: the output of layer L + tap_shift for each tap L
    (HF hidden_states[0] is the embedding output, so that is hidden_states[L + tap_shift + 1])."""
    return torch.cat([hidden_states[L + config.tap_shift + 1] for L in config.target_layer_ids], dim=-1)
