"""Device tests of the exllamav3 backend on the shipped tiny pair (skipped without CUDA and exllamav3).

    source .device/on-device.sh && python -m pytest -q tests/test_exl3_gpu.py -m gpu
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from stream_shape import assert_stream_shape

from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_pair(pair):
    """TOOLKIT_GPU_PAIR=target:draft (the device_check script trains a hidden-128 pair), else the shipped pair."""
    env = os.environ.get("TOOLKIT_GPU_PAIR")
    return tuple(Path(p) for p in env.split(":")) if env else pair


@pytest.fixture(scope="module")
def exl3(gpu_pair):
    pytest.importorskip("exllamav3")
    from toolkit.exl3.backend import Exl3Backend

    be = Exl3Backend.from_dirs(*gpu_pair, cache_tokens=8 * 512, max_concurrency=8)
    yield be
    be.close()


@pytest.fixture(scope="module")
def torch_be(gpu_pair):
    from toolkit.runtime.torch_backend import TorchBackend

    return TorchBackend.from_dirs(*gpu_pair)


def prompts(tok, n=6):
    from toolkit.train.tiny import corpus

    ids = tok.encode(corpus()[:20000])
    return [ids[k * 300:k * 300 + 32] for k in range(1, n + 1)]


@pytest.mark.parametrize("B", [8, 16])
def test_greedy_is_lossless_against_its_own_ar(exl3, B):
    st = GenSettings(max_new_tokens=48, block_size=B)
    for p in prompts(exl3.tokenizer):
        rounds = list(exl3.generate(p, st))
        assert tokens_of(rounds) == tokens_of(exl3.generate(p, st, speculative=False))
        assert_stream_shape(rounds, width=B - 1, max_new_tokens=48, stop_ids=set(exl3.eos_ids))


def test_both_backends_emit_the_same_stream_shape(exl3, torch_be):
    st = GenSettings(max_new_tokens=32, block_size=16)
    for p in prompts(exl3.tokenizer, 3):
        for be in (exl3, torch_be):
            assert_stream_shape(list(be.generate(p, st)), width=15, max_new_tokens=32, stop_ids=set(be.eos_ids))
