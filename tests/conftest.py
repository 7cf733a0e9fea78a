"""Shared fixtures: tiny models built once per session in a temp dir (seconds, offline)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The commands the tests run as subprocesses inherit this: one torch thread each, as set_num_threads(1) below does
# in-process. Two test workers whose children each start a thread per core oversubscribe a 2-core machine, and
# spinning OpenMP threads then made the tiny models' matmuls 10-20 times slower on a busy one (load 7: preview_run
# took 88 CPU s, 12 with one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DFLASH_DEMO", "tiny")          # app tests run the fast toy pair; slow/test_demo_app.py runs SmolLM2
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)  # tiny models: one thread beats two on a 2-core machine


# `--dist loadfile` deals whole files to the workers in collection order (xdist would otherwise order them by
# their number of tests): the longest go first, so that none is dealt last to one worker while the other has run out
# of files. Each tier's longest on 2 workers, longest first (2026-12-07); the files not listed follow in their order.
LONGEST = ("slow/test_killed_writers.py", "slow/test_lossless.py", "slow/test_bad_input.py", "slow/test_app_browser.py",
           "slow/test_grouped_moe.py", "slow/test_space.py", "slow/test_fuzz.py",
           "test_generate.py", "test_quantize_exl3.py", "test_quantize_pipeline.py", "test_moe_lever.py",
           "test_bad_input_files.py", "test_quantize_offline.py", "test_policy_backend.py")
HERE = os.path.dirname(os.path.abspath(__file__))


SLOW = os.path.join(HERE, "slow")


def pytest_ignore_collect(collection_path, config):
    """A tier collects its own files alone (each worker imports every file it collects): `-m slow` those in
    tests/slow/, `-m "not slow"` the others. tests/test_layout.py checks that no test outside tests/slow/ is marked
    slow; any other -m expression collects everything."""
    tier = (config.getoption("markexpr", "") or "").strip()
    if tier not in ("slow", "not slow"):
        return None
    path = str(collection_path)
    inside = path == SLOW or path.startswith(SLOW + os.sep)
    if tier == "not slow" and inside:
        return True
    if tier == "slow" and not inside and os.path.basename(path).startswith("test_") and path.endswith(".py"):
        return True
    return None


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False                 # keep the order pytest_collection_modifyitems gives


def longest_first(item) -> int:
    rel = os.path.relpath(str(item.path), HERE).replace(os.sep, "/")
    return LONGEST.index(rel) if rel in LONGEST else len(LONGEST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=longest_first)                                # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and exllamav3 (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Random tiny targets + drafters for every supported architecture: {arch: (target_dir, draft_dir)}."""
    from toolkit.assets.fixtures import ARCHS, build

    root = tmp_path_factory.mktemp("fixtures")
    return {arch: build(root, arch=arch, block_size=16, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def pair():
    from toolkit.assets.fixtures import tiny_pair

    return tiny_pair()


@pytest.fixture(scope="session")
def pair_backend(pair):
    from toolkit.runtime.torch_backend import TorchBackend

    return TorchBackend.from_dirs(*pair)


@pytest.fixture
def steady_costs(monkeypatch):
    """Tables timed on this machine count as steady: the tiny pair's few-ms rounds, timed on a loaded CPU, can
    contradict themselves or disagree with the live rounds (such a table is timed again and not cached, or leaves the
    cache: tested in test_policy_costs.py); the tests that take this fixture test the caching itself."""
    from toolkit.costs.table import CostTable

    monkeypatch.setattr(CostTable, "contradiction", lambda self: "")
    monkeypatch.setattr("toolkit.costs.cache.forget", lambda path: None)
    monkeypatch.setattr("toolkit.costs.cache.stale", lambda table, now: "")


@pytest.fixture
def interrupt_training(monkeypatch):
    """`with interrupt_training(step):` train_drafter stops with KeyboardInterrupt right after saving the checkpoint
    of `step` (expected inside the block), as a killed device call would; the real save comes back afterwards."""
    import contextlib

    import toolkit.train.trainer as td

    @contextlib.contextmanager
    def at(step: int):
        real = td.save_checkpoint

        def interrupt(ckdir, model, st, run):
            real(ckdir, model, st, run)
            if st.step == step:
                raise KeyboardInterrupt
        monkeypatch.setattr(td, "save_checkpoint", interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            monkeypatch.setattr(td, "save_checkpoint", real)
    return at
