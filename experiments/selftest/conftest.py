"""What the self-check's tests share with tests/ (the same settings as tests/conftest.py): offline, one torch
thread, and the tiny trained pair. The stand-ins they run on (exl3_fakes, test_quantize_fakes, ...) are tests/'s
helpers, on the path through pyproject's pythonpath."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pair():
    from toolkit.assets.fixtures import tiny_pair

    return tiny_pair()
