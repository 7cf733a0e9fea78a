"""`--draft mtp` on the exllamav3 backend, on CPU: the target's MTP component loaded from the target's own config
(as exllamav3's `--mtp` does) and refused in one line where exllamav3 has none, its rounds captured from the MTP
drafting step into the same Round stream, and the memory check counting the head as the drafter."""

from __future__ import annotations

import types

import pytest
from exl3_fakes import FakeGenerator, FakeJob, FakeModel, FakeTokenizer, LoadedModel, ar_reference, fake_loader, install_loader, install_sampler_modules
from stream_shape import assert_stream_shape

from toolkit.core.errors import ToolkitError
from toolkit.mtp import DEPTH, MTP
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of


class FakeMtpGenerator(FakeGenerator):
    """The stand-in Generator with an MTP drafter: exllamav3 calls its MTP drafting step, never the DFlash one."""

    block = DEPTH
    draft_step = "iterate_draftmodel_mtp_gen"
    iterate_draftmodel_mtp_gen = FakeGenerator.iterate_draftmodel_dflash_gen

    def iterate_draftmodel_dflash_gen(self, results, window):
        raise AssertionError("an MTP drafter drafts through iterate_draftmodel_mtp_gen")


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    from toolkit.assets.fixtures import build

    return build(tmp_path_factory.mktemp("mtp"), arch="qwen3_5_moe", mtp=True)[0]


def mtp_backend(monkeypatch, tmp_path):
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.exl3.engine import Exl3Engine

    install_sampler_modules(monkeypatch)
    monkeypatch.setattr(FakeGenerator, "built", [])
    exl = types.SimpleNamespace(Generator=FakeMtpGenerator, Job=FakeJob)
    engine = Exl3Engine(exl, FakeModel(), types.SimpleNamespace(max_num_tokens=8192), None, draft=FakeModel(),
                        draft_cache="dc", block_size=DEPTH + 1, max_concurrency=8, mtp=True)
    return Exl3Backend(engine, FakeTokenizer(), max_context=4096, eos_ids=(5,), device="cpu",
                       cost_cache=tmp_path / "costs", moe_class=type(None))


@pytest.mark.parametrize("block", [2, DEPTH + 1])
def test_mtp_rounds_are_captured_from_its_drafting_step(monkeypatch, tmp_path, block):
    be = mtp_backend(monkeypatch, tmp_path)
    prompts = [[1, 2, 3], [4, 9], [20, 21, 22, 23]]
    per_job: dict[int, list] = {i: [] for i in range(len(prompts))}
    for i, r in be.generate_many(prompts, GenSettings(max_new_tokens=30, block_size=block)):
        per_job[i].append(r)
    for i, p in enumerate(prompts):
        assert tokens_of(per_job[i]) == ar_reference(p, 30)
        assert_stream_shape(per_job[i], width=block - 1, max_new_tokens=30)
    assert {r.accepted for rs in per_job.values() for r in rs[:-1]} >= {0, block - 1}


def test_auto_on_mtp_drafts_the_whole_depth_and_stays_lossless(monkeypatch, tmp_path):
    be = mtp_backend(monkeypatch, tmp_path)
    rounds = list(be.generate([7, 8], GenSettings(max_new_tokens=40)))
    assert tokens_of(rounds) == ar_reference([7, 8], 40)
    assert all(r.proposed == DEPTH for r in rounds if r.drafted) and be.engine.gen.max_draft_tokens == DEPTH


def mtp_loader(monkeypatch, components=("text", "mtp")) -> list:
    """install_loader's exllamav3 whose Config knows its components and whose Model builds one of them."""
    from toolkit.exl3 import engine as exl3_engine

    log = install_loader(monkeypatch, 1)
    exl = fake_loader(log)

    class Config(str):
        model_classes = dict.fromkeys(components)

    exl.Config = types.SimpleNamespace(from_directory=lambda d: Config(d.rstrip("/").split("/")[-1]))
    exl.Model = types.SimpleNamespace(from_config=lambda cfg, component="text": LoadedModel(
        cfg if component == "text" else f"{cfg}:{component}", log))
    monkeypatch.setattr(exl3_engine, "import_exllamav3", lambda: exl)
    return log


def test_the_mtp_head_loads_as_exllamav3s_mtp_component_of_the_target(mtp_target, monkeypatch):
    from toolkit.exl3.backend import Exl3Backend

    log = mtp_loader(monkeypatch)
    be = Exl3Backend.from_dirs(mtp_target, MTP, cache_tokens=4096, max_concurrency=4)
    name = mtp_target.name
    assert log == [(f"{name}:mtp", {"progressbar": False}, False), (name, {"progressbar": False}, True)]
    assert be.mtp and be.block_size == DEPTH + 1 and be.folders == (mtp_target,)
    assert be.draft.folder == f"{name}:mtp" and be.draft_cache.max_num_tokens == be.cache.max_num_tokens == 4096


def test_exllamav3_without_an_mtp_component_for_the_target_is_one_line(mtp_target, monkeypatch):
    from toolkit.exl3.backend import Exl3Backend

    mtp_loader(monkeypatch, components=("text",))
    with pytest.raises(ToolkitError, match=r"^--draft mtp: exllamav3 has no MTP drafter for .*ConditionalGeneration"):
        Exl3Backend.from_dirs(mtp_target, MTP, cache_tokens=4096, max_concurrency=4)


def test_a_target_without_a_head_is_refused_before_exllamav3_loads(pair, monkeypatch):
    from toolkit.exl3.backend import Exl3Backend

    log = mtp_loader(monkeypatch)
    with pytest.raises(ToolkitError, match="carries no MTP head"):
        Exl3Backend.from_dirs(pair[0], MTP)
    assert log == []


def test_the_head_counts_as_the_drafter_not_as_target_layer_0(mtp_target):
    from toolkit.core.target import read_optional
    from toolkit.core.tensorfiles import tensor_shapes
    from toolkit.exl3.memory import cache_bytes, check_memory, layer_weight_bytes, mtp_bytes

    G = 1 << 30
    per, rest = layer_weight_bytes(mtp_target, 4)
    shapes = tensor_shapes(mtp_target / "model.safetensors")
    head = sum(2 * _numel(s) for k, (_, s) in shapes.items() if k.startswith("mtp."))       # F32 loads as fp16
    trunk = sum(2 * _numel(s) for k, (_, s) in shapes.items() if not k.startswith("mtp."))
    assert sum(per) + rest == trunk
    cfg = read_optional(mtp_target / "config.json")
    one_layer = cache_bytes({**cfg, "num_hidden_layers": 1, "layer_types": ["full_attention"]}, 4096, 0)
    assert mtp_bytes(mtp_target, cfg, 4096) == (head, one_layer)
    needs = check_memory(mtp_target, None, 4096, 4, "FakeGPU", free=[80 * G], mtp=True)
    assert needs[0].draft == head + one_layer
    assert check_memory(mtp_target, None, 4096, 4, "FakeGPU", free=[80 * G])[0].draft == 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
