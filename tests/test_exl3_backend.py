"""The exllamav3 backend on CPU: imports without CUDA, one-line loading errors, the round capture and the
job bookkeeping of generate_many against a small stand-in for exllamav3's Generator. The real thing runs on
the device (tests/test_exl3_gpu.py, experiments/device_check.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exl3_fakes import V, Clock, FakeGenerator, ar_reference, make_backend, target_next  # noqa: F401  (re-exported)
from experiments.stream_shape import assert_stream_shape
from toolkit.core.errors import ToolkitError
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round, tokens_of
from toolkit.runtime.exl3_hook import JobTrack, build_round, check_version, recording_generator_class


def test_module_imports_without_exllamav3_or_cuda():
    code = ("import sys, toolkit.runtime.exl3_backend, toolkit.runtime.factory; "
            "print('exllamav3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1], env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    assert out.stdout.strip() == "False"


def test_version_pin_messages():
    with pytest.raises(ToolkitError, match=r"not installed.*\[gpu\].*exllamav3==1\.6\.5"):
        check_version(None)
    with pytest.raises(ToolkitError, match=r"exllamav3 1\.7\.0 is installed.*pinned to 1\.6\.5"):
        check_version("1.7.0")
    check_version("1.6.5")


def test_no_cuda_names_the_gpu_needed(monkeypatch):
    from toolkit.runtime import exl3_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ToolkitError, match=r"no CUDA GPU.*NVIDIA GPU.*compute capability 8\.0.*--backend torch") as e:
        exl3_backend.check_cuda()
    assert "\n" not in str(e.value)


def test_from_dirs_rejects_a_drafter_that_does_not_fit(pair, tmp_path):
    from toolkit.runtime.exl3_backend import Exl3Backend

    target, draft = pair
    for key, value, pattern in (("hidden_size", 32, r"hidden_size: drafter has 32, target has 128"),
                                ("target_layer_ids", [0, 9], r"target_layer_ids: tap 9")):
        bad = tmp_path / f"draft-{key}"
        shutil.copytree(draft, bad)
        cfg = json.loads((bad / "config.json").read_text())
        if key == "hidden_size":
            cfg["hidden_size"] = value
        else:
            cfg["dflash_config"]["target_layer_ids"] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ToolkitError, match=rf"drafter .* does not fit target .*: {pattern}"):
            Exl3Backend.from_dirs(target, bad)


def test_memory_check_says_needed_and_free(pair, monkeypatch):
    from toolkit.runtime import exl3_backend

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (256 * 1024**2, 80 * 1024**3))
    with pytest.raises(ToolkitError, match=r"not enough GPU memory on H200: loading needs about 0\.\d GiB .* 0\.2 GiB is free"):
        exl3_backend.check_memory(pair[0], pair[1], 32768, 32, "H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * 1024**3, 80 * 1024**3))
    exl3_backend.check_memory(pair[0], pair[1], 32768, 32, "H200")


# -- the capture ------------------------------------------------------------------------------------


def test_build_round_full_partial_zero_clipped_and_ar():
    tr = JobTrack(0, prompt_len=5)
    drafted = (10, 11, 12, 13)
    r = build_round(tr, [10, 11, 12, 13, 14], [(0, 4, 4)], drafted, 1.0, 3.0)   # full: 4 drafts + bonus
    assert (r.accepted, r.bonus, r.prefill, r.full, r.t_verify_ms) == (4, 14, True, True, 2.0)
    r = build_round(tr, [10, 99], [(0, 4, 4), (5, 4, 1)], drafted, 1.0, 3.0)     # partial, correction 99
    assert (r.accepted, r.bonus, r.prefill) == (1, 99, False)
    r = build_round(tr, [7], [(0, 4, 4), (5, 4, 1), (7, 4, 0)], drafted, 1.0, 3.0)  # zero accepted
    assert r.tokens == [7] and r.drafted == drafted
    assert build_round(tr, [], [(0, 4, 4), (5, 4, 1), (7, 4, 0)], None, 0, 1) is None  # still prefilling
    ar = build_round(JobTrack(1, 3), [42], [], None, 0.0, 2.0)
    assert ar == Round((), 0, 42, 0.0, 2.0, True)
    with pytest.raises(RuntimeError, match="out of step"):
        build_round(JobTrack(2, 3), [10, 12, 5], [(0, 4, 2)], drafted, 0, 1)
    with pytest.raises(RuntimeError, match="without a verified draft"):
        build_round(JobTrack(3, 3), [1, 2], [], None, 0, 1)


def test_recording_generator_keeps_drafted_rows_per_job():
    class Job:
        def __init__(self, done):
            self.done = done

        def is_prefill_done(self):
            return self.done

    class Base:
        def __init__(self):
            self.active_jobs = [Job(True), Job(False), Job(True)]

        def iterate(self):
            return [self.iterate_draftmodel_dflash_gen([], 3)]

        def iterate_draftmodel_dflash_gen(self, results, window):
            return torch.arange(12).view(4, 3)      # pinned buffer: more rows than jobs

    g = recording_generator_class(Base)()
    assert torch.equal(g.iterate()[0], torch.arange(12).view(4, 3))
    a, _, c = g.active_jobs
    assert g.drafted == {id(a): (0, 1, 2), id(c): (3, 4, 5)} and g.t_draft_ms >= 0
    with pytest.raises(ToolkitError, match="no iterate_draftmodel_dflash_gen"):
        recording_generator_class(object)


# -- generate_many against a stand-in Generator (tests/exl3_fakes.py) ---------------------------------------


@pytest.fixture
def fake_backend(monkeypatch, tmp_path):
    return make_backend(monkeypatch, tmp_path)


def test_generate_many_rounds_match_the_tokens(fake_backend):
    prompts = [[1, 2, 3], [4, 9], [20, 21, 22, 23], [30]]
    st = GenSettings(max_new_tokens=40, block_size=6)
    per_job = {i: [] for i in range(len(prompts))}
    for i, r in fake_backend.generate_many(prompts, st):
        per_job[i].append(r)
    for i, p in enumerate(prompts):
        rounds = per_job[i]
        assert tokens_of(rounds) == ar_reference(p, 40)
        assert_stream_shape(rounds, width=5, max_new_tokens=40)
        assert rounds[0].prefill and not any(r.prefill for r in rounds[1:])
    seen = {r.accepted for rs in per_job.values() for r in rs[:-1]}
    assert {0, 5} <= seen and seen & {1, 2, 3, 4}              # zero, full and partial acceptance


def test_ar_mode_same_cache_new_generator(fake_backend):
    spec = list(fake_backend.generate([7, 8], GenSettings(max_new_tokens=30)))
    g_spec = fake_backend._gen
    ar = list(fake_backend.generate([7, 8], GenSettings(max_new_tokens=30), speculative=False))
    assert fake_backend._gen is not g_spec and fake_backend._gen.window == 0
    assert tokens_of(ar) == tokens_of(spec) == ar_reference([7, 8], 30)
    assert all(r.drafted == () for r in ar) and len(ar) == len(tokens_of(ar))
    assert_stream_shape(ar, width=0, max_new_tokens=30)


def test_generate_many_checks_its_inputs(fake_backend):
    with pytest.raises(ToolkitError, match="prompt is empty"):
        list(fake_backend.generate([], GenSettings()))
    with pytest.raises(ToolkitError, match="9 jobs exceed max_concurrency 8"):
        list(fake_backend.generate_many([[1]] * 9, GenSettings()))
    with pytest.raises(ToolkitError, match="exceeds the context of 4096"):
        list(fake_backend.generate([1] * 4090, GenSettings(max_new_tokens=10)))


def test_torch_stream_has_the_same_shape(pair_backend):
    ids = pair_backend.tokenizer.encode("Return a new list of the items")
    rounds = list(pair_backend.generate(ids, GenSettings(max_new_tokens=24, block_size=8)))
    assert_stream_shape(rounds, width=7, max_new_tokens=24)
