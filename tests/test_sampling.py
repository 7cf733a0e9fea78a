"""Temperature > 0 keeps the target's distribution: token frequencies from speculative sampling vs exact marginals."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.assets.fixtures import drafter_config, random_drafter
from toolkit.runtime.loop import decode
from toolkit.runtime.sampling import Sampler
from toolkit.runtime.torch_backend import TorchSteps

V, T, N = 8, 1.0, 2000
PROMPT = [1, 4, 2]


def tiny_target():
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, initializer_range=0.4,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def exact_marginals(model, depth):
    """P(token at generated position k) for k < depth, by enumerating every prefix."""
    def probs(ids):
        return torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double() / T, -1)
    out, prefixes = [], {(): 1.0}
    for _ in range(depth):
        m = torch.zeros(V, dtype=torch.float64)
        nxt = {}
        for pre, p in prefixes.items():
            q = probs(PROMPT + list(pre)) * p
            m += q
            for t in range(V):
                nxt[pre + (t,)] = q[t].item()
        out.append(m)
        prefixes = nxt
    return out


class ModeDrafter(TorchSteps):
    """The real target and verify path; drafts always propose token 4, the target's most likely token here,
    so that accepted drafts, partial blocks and corrections all occur (a random drafter is almost never right)."""

    def draft_block(self, token, width):
        return [4] * width


def test_speculative_sampling_keeps_target_distribution():
    target = tiny_target()
    drafter = random_drafter(drafter_config(16, [0], V - 1, 4, vocab_size=V, window=8), seed=2, std=0.5)
    depth = 3
    counts = torch.zeros(depth, V, dtype=torch.float64)
    accepted = drafted_first = 0
    for seed in range(N):
        rounds = list(decode(ModeDrafter(target, drafter), PROMPT, depth, Sampler(T, seed), set(), 3))
        toks = [t for r in rounds for t in r.tokens]
        for k, t in enumerate(toks[:depth]):
            counts[k, t] += 1
        accepted += sum(r.accepted for r in rounds)
        drafted_first += sum(1 for r in rounds if r.drafted)
    exact = exact_marginals(target, depth)
    freq = counts / N
    tv = [0.5 * (freq[k] - exact[k]).abs().sum().item() for k in range(depth)]
    assert all(t < 0.06 for t in tv), tv
    assert accepted > 0.2 * drafted_first            # drafts were accepted often enough to matter
    # the test has power: a distribution visibly different from the target's fails the bound
    uniform = torch.full((V,), 1.0 / V, dtype=torch.float64)
    assert 0.5 * (uniform - exact[1]).abs().sum().item() > 0.1
