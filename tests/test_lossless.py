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


def check(backend, prompt, block, n=24):
    ids = backend.tokenizer.encode(prompt)
    s = GenSettings(max_new_tokens=n, block_size=block)
    spec = list(backend.generate(ids, s))
    ar = list(backend.generate(ids, s, speculative=False))
    assert tokens_of(spec) == tokens_of(ar), (prompt, block)
    assert all(len(r.drafted) == block - 1 for r in spec[1:] if not r.prefill)
    return spec


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_lossless_random_targets(models, arch):
    backend = TorchBackend.from_dirs(*models[arch])
    for block in BLOCKS:
        for p in PROMPTS:
            check(backend, p, block)


def test_lossless_qwen3(models):
    backend = TorchBackend.from_dirs(*models["qwen3"])
    for p in PROMPTS[:5]:
        check(backend, p, 8)


def test_lossless_trained_pair_with_all_acceptance_cases(pair_backend):
    seen = {"zero": 0, "partial": 0, "full": 0}
    for block in BLOCKS:
        for p in PROMPTS:
            for r in check(pair_backend, p, block, n=48)[1:]:
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
    rounds = list(pair_backend.generate(pair_backend.encode("Return the list of"), GenSettings(max_new_tokens=64)))
    assert summarize(rounds).tau > 1.0
