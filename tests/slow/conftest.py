"""The slow tier: every test in this folder carries the `slow` marker, so `python -m pytest -q -m "not slow"` is the
fast everyday run and CI runs both. A test belongs here when it is slow by design: the policy replay, the Triton
kernels under the interpreter, the browser, fuzzing, signals with sleeping children, training and the quantize
pipeline on the CPU."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
