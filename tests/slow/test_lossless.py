"""Greedy speculative decoding is token for token identical to the AR baseline on the same target."""

import pytest

from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import summarize, tokens_of
from toolkit.runtime.torch_backend import TorchBackend

PROMPTS = [
    "Return the list of", "Create a new", "Open the file", "Write a function", "The default value", "hi",
    "Parse the arguments", "Raise an error if", "Convert a string to", "Return True if", "Split the path",
    "If the option is", "Read the data from", "A dictionary of", "Call the function", "The number of",
    "This module provides", "Set the value of", "Return a new object", "Add an argument",
]
BLOCKS = [4, 8, 16]


def ar_tokens(backend, ids: list[int], s: GenSettings, memo: dict | None) -> list[int]:
    """The AR baseline of `ids`, decoded once per target and length: greedy AR reads neither the drafter nor the
    block size, so every block size and cost table of one target compares against the same tokens (a block size
    that changed AR's output would then fail against the first one's)."""
    key = (tuple(ids), s.max_new_tokens)
    if memo is None or key not in memo:
        got = tokens_of(backend.generate(ids, s, speculative=False))
        if memo is None:
            return got
        memo[key] = got
    return memo[key]


def check(backend, prompt, block, n=24, memo=None):
    ids = backend.tokenizer.encode(prompt)
    s = GenSettings(max_new_tokens=n, block_size=block)
    spec = list(backend.generate(ids, s))
    assert tokens_of(spec) == ar_tokens(backend, ids, s, memo), (prompt, block)
    assert all(len(r.drafted) == block - 1 for r in spec[1:] if not r.prefill)
    return spec


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_lossless_random_targets(models, arch):
    """Every block size over half the prompts (a random target rejects nearly every draft, so each prompt costs
    about as many rounds as tokens; the trained pair below covers every prompt)."""
    backend, memo = TorchBackend.from_dirs(*models[arch]), {}
    for block in BLOCKS:
        for p in PROMPTS[::2]:
            check(backend, p, block, memo=memo)


def test_lossless_qwen3(models):
    backend = TorchBackend.from_dirs(*models["qwen3"])
    for p in PROMPTS[:5]:
        check(backend, p, 8)


def test_lossless_trained_pair_with_all_acceptance_cases(pair_backend):
    seen, memo = {"zero": 0, "partial": 0, "full": 0}, {}
    for block in BLOCKS:
        for p in PROMPTS:
            for r in check(pair_backend, p, block, n=48, memo=memo)[1:]:
                seen["zero" if r.accepted == 0 else "full" if r.full else "partial"] += 1
    assert all(seen.values()), seen


def test_random_target_output_depends_on_context(models, pair_backend):
    for backend in (TorchBackend.from_dirs(*models["llama"]), pair_backend):
        outs = []
        for p in ("Return the list of", "Open the file"):
            s = GenSettings(max_new_tokens=64, stop_ids=())              # no EOS stop: look at 64 tokens
            toks = tokens_of(backend.generate(backend.tokenizer.encode(p), s, speculative=False))
            assert len(set(toks)) >= 10, toks
            outs.append(toks)
        assert outs[0] != outs[1]


def test_trained_pair_accepts_drafts(pair_backend):
    rounds = list(pair_backend.generate(pair_backend.encode("Return the list of"), GenSettings(max_new_tokens=64, block_size=16)))
    assert summarize(rounds).tau > 1.0


# -- block_size "auto": the drafting policy picks each round's width (0 = a plain AR round) ------------------------

def check_auto(backend, prompt, n=32, memo=None):
    ids = backend.tokenizer.encode(prompt)
    s = GenSettings(max_new_tokens=n)                               # block_size "auto" is the default
    spec = list(backend.generate(ids, s))
    assert tokens_of(spec) == ar_tokens(backend, ids, s, memo), prompt
    assert all(len(r.drafted) <= backend.block_size - 1 for r in spec)
    return [len(r.drafted) for r in spec[1:]]


def cheap_costs(block):
    """Verifying is nearly free: the policy drafts, at widths that follow the running acceptance."""
    from toolkit.costs.table import CostTable

    return CostTable({1: {0: 10.0, **{w: 10.2 + 0.2 * w for w in range(1, block)}}})      # every width timed


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_auto_lossless_random_targets(models, arch):
    backend = TorchBackend.from_dirs(*models[arch])
    backend.book.give(cheap_costs(backend.block_size), learn=False)
    policy = backend.policy(True)
    for _ in range(3):
        policy.learn(2, policy.fade(1))                              # start as if 2 drafts were accepted
    widths = [w for p in PROMPTS[:10] for w in check_auto(backend, p)]
    assert len(set(widths)) >= 2, set(widths)                        # variable widths, the recurrent target included


def test_auto_lossless_trained_pair(pair_backend):
    from toolkit.runtime.torch_backend import TorchBackend as TB

    memo = {}                                                        # one target: one AR baseline per prompt
    for costs in (None, cheap_costs(16)):                            # the measured table, then one that drafts
        be = TB(pair_backend.target, pair_backend.tokenizer, pair_backend.drafter, costs=costs)
        widths = [w for p in PROMPTS[:10] for w in check_auto(be, p, n=48, memo=memo)]
        if costs is not None:
            assert len(set(widths)) >= 3 and 0 < sum(map(bool, widths)), set(widths)


@pytest.mark.slow
def test_auto_lossless_smollm2_pair():
    """The demo pair (SmolLM2-135M-Instruct + its drafter) under the policy, greedy: identical to AR (~20 s)."""
    from toolkit.assets.smollm2 import default_pair
    from toolkit.core.errors import ToolkitError

    try:
        target, draft = default_pair()
    except ToolkitError as e:
        pytest.skip(f"SmolLM2 demo pair unavailable: {e}")
    be = TorchBackend.from_dirs(target, draft)
    be.book.give(cheap_costs(be.block_size), learn=False)            # drafts every round, widths from acceptance
    widths = []
    for p in ("Write a Python function that checks whether a string is a palindrome.", "List five facts about the Moon."):
        ids = be.encode(p)
        s = GenSettings(max_new_tokens=40)
        spec = list(be.generate(ids, s))
        assert tokens_of(spec) == tokens_of(be.generate(ids, s, speculative=False)), p
        assert summarize(spec).tau > 1.0
        widths += [len(r.drafted) for r in spec[1:]]
    assert len(set(widths)) >= 2, set(widths)
