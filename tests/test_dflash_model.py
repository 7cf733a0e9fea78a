"""The reference drafter against a forward written out by hand in float64, and its cached path."""

import math

import torch

from toolkit.dflash import DFlashConfig, DraftCache
from toolkit.assets.fixtures import drafter_config, random_drafter


def tiny(window=3, block=4, is_causal=None):
    cfg = drafter_config(hidden=16, taps=[0, 2], mask_id=5, block_size=block, layers=2, vocab_size=32, window=window)
    if is_causal is not None:
        cfg["dflash_config"]["is_causal"] = is_causal
    return random_drafter(cfg, seed=3, std=0.3)


def rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rot(x, p, theta):
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        a = p * theta ** (-2 * i / d)
        c, s = math.cos(a), math.sin(a)
        out[..., i] = x[..., i] * c - x[..., i + d // 2] * s
        out[..., i + d // 2] = x[..., i + d // 2] * c + x[..., i] * s
    return out


def by_hand(model, noise, taps, n_ctx):
    """Plain loops over positions and heads, float64, straight from the weights."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    c: DFlashConfig = model.config
    eps, H, KV, D, th = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_theta
    ctx = rms(taps.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = noise.double()
    B = x.shape[0]
    for L in range(c.num_hidden_layers):
        p = f"layers.{L}."
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        rows = torch.cat([ctx, h])                        # context rows, then block rows
        pos = list(range(n_ctx)) + list(range(n_ctx, n_ctx + B))
        k = (rows @ sd[p + "self_attn.k_proj.weight"].T).view(-1, KV, D)
        v = (rows @ sd[p + "self_attn.v_proj.weight"].T).view(-1, KV, D)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, H, D)
        k = torch.stack([rot(rms(k[j], sd[p + "self_attn.k_norm.weight"], eps), pos[j], th) for j in range(len(pos))])
        q = torch.stack([rot(rms(q[i], sd[p + "self_attn.q_norm.weight"], eps), n_ctx + i, th) for i in range(B)])
        out = torch.zeros(B, H, D, dtype=torch.float64)
        for i in range(B):
            qp = n_ctx + i
            for hd in range(H):
                g = hd // (H // KV)
                ok = []
                for j, kp in enumerate(pos):
                    in_block = j >= n_ctx
                    if c.window(L) is not None and abs(qp - kp) >= c.window(L):
                        continue
                    if in_block and c.block_causal(L) and kp > qp:
                        continue
                    ok.append(j)
                s = torch.stack([q[i, hd] @ k[j, g] for j in ok]) / math.sqrt(D)
                w = torch.softmax(s, 0)
                out[i, hd] = sum(w[t] * v[j, g] for t, j in enumerate(ok))
        x = x + out.reshape(B, -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"], eps)


def inputs(model, n_ctx=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    taps = torch.randn(n_ctx, len(c.target_layer_ids) * c.hidden_size, generator=g)
    noise = torch.randn(c.block_size, c.hidden_size, generator=g)
    return noise, taps


def test_forward_matches_hand_computation_float32_vs_float64():
    for is_causal in (None, False, True):
        model = tiny(is_causal=is_causal).float()
        noise, taps = inputs(model)
        pos = torch.arange(6 + model.config.block_size)
        got = model(noise[None], taps[None], pos)[0].double()
        want = by_hand(model, noise, taps, 6)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (is_causal, (got - want).abs().max())


def test_cached_path_equals_stateless_forward():
    model = tiny(window=4).double()
    emb = torch.randn(32, 16, dtype=torch.float64)
    taps = torch.randn(1, 9, 32, dtype=torch.float64)
    cache = DraftCache(model)
    model.extend(cache, taps[:, :5])          # context grows in accepted chunks; sliding layer keeps its window
    model.extend(cache, taps[:, 5:9])
    assert cache.length == 9 and cache.k[0].shape[1] == 4 and cache.k[1].shape[1] == 9
    token = torch.tensor([7])
    got = model.draft_hidden(cache, token, emb)
    noise = model.embed_block(token, emb)
    want = model(noise, taps, torch.arange(9 + model.config.block_size))
    assert torch.allclose(got, want, atol=1e-10)
    assert (noise[0, 1:] == emb[5]).all() and (noise[0, 0] == emb[7]).all()


def test_ctx_keep_hides_later_context_rows():
    model = tiny().double()
    noise, taps = inputs(model, n_ctx=8)
    noise, taps = noise.double(), taps.double()
    pos_short = torch.arange(5 + model.config.block_size)
    short = model(noise[None], taps[None, :5], pos_short)
    keep = torch.arange(8)[None] < 5
    pos = torch.cat([torch.arange(8), torch.arange(5, 5 + model.config.block_size)])
    masked = model(noise[None], taps[None], pos[None], ctx_keep=keep)
    assert torch.allclose(short, masked, atol=1e-10)
