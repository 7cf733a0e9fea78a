"""Two GPUs (issue 21) on CPU: --gpu-split / --tensor-parallel / --draft-device parsing, the per-device memory
estimate and its refusals, the exllamav3 load arguments of each placement (through the fake loader of
exl3_fakes), and a split onto one device decoding exactly as no split does."""

from __future__ import annotations

import argparse

import pytest
from exl3_fakes import ar_reference, install_loader

from toolkit.core.errors import OptionError, ToolkitError
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of
from toolkit.exl3.memory import (
    GIB,
    check_memory,
    layer_weight_bytes,
    plan_devices,
    weight_bytes,
)
from toolkit.runtime.placement import GpuSplit, add_split_args, from_env

# -- parsing ----------------------------------------------------------------------------------------------


def test_split_values_parse():
    assert GpuSplit().default and GpuSplit.of(None, False, None).default
    assert GpuSplit.of("auto").gpu_split == "auto" and GpuSplit.of(" AUTO ").gpu_split == "auto"
    assert GpuSplit.of("16,16").gpu_split == (16.0, 16.0)
    assert GpuSplit.of("12.5").gpu_split == (12.5,) and GpuSplit.of([8, 7.5]).gpu_split == (8.0, 7.5)
    assert GpuSplit.of("16,16", True, 1).tag == "split 16,16, tensor-parallel, drafter cuda:1"
    assert GpuSplit.of(tensor_parallel=True).tag == "tensor-parallel"


@pytest.mark.parametrize("bad", ["0,16", "-1", "nan", "inf,8", "abc", "16,,16", "16;16", [True]])
def test_bad_split_values_name_the_field(bad):
    with pytest.raises(OptionError, match=r"^gpu_split must be auto or GB per device .*positive") as e:
        GpuSplit.of(bad)
    assert e.value.field == "gpu_split" and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [-1, "1", 1.0, True])
def test_bad_draft_device_names_the_field(bad):
    with pytest.raises(OptionError, match=r"^draft_device must be a GPU index >= 0") as e:
        GpuSplit(draft_device=bad)
    assert e.value.field == "draft_device"


def test_command_line_and_environment():
    ap = argparse.ArgumentParser()
    add_split_args(ap)
    a = vars(ap.parse_args(["--gpu-split", "16,16", "--tensor-parallel", "--draft-device", "1"]))
    assert GpuSplit.of(**a) == GpuSplit((16.0, 16.0), True, 1)
    assert GpuSplit.of(**vars(ap.parse_args([]))).default
    assert from_env({}).default
    env = {"DFLASH_GPU_SPLIT": "auto", "DFLASH_TENSOR_PARALLEL": "1", "DFLASH_DRAFT_DEVICE": "1"}
    assert from_env(env) == GpuSplit("auto", True, 1)
    with pytest.raises(OptionError, match="DFLASH_DRAFT_DEVICE.*'x'"):
        from_env({"DFLASH_DRAFT_DEVICE": "x"})
    with pytest.raises(OptionError, match="DFLASH_TENSOR_PARALLEL"):
        from_env({"DFLASH_TENSOR_PARALLEL": "maybe"})
    with pytest.raises(OptionError, match="gpu_split must be"):
        from_env({"DFLASH_GPU_SPLIT": "16,x"})


def test_devices_this_machine_lacks_are_one_line_errors():
    with pytest.raises(OptionError, match=r"^gpu_split lists 2 devices, this machine has 1 GPU$"):
        GpuSplit.of("16,16").check_devices(1)
    with pytest.raises(OptionError, match=r"^draft_device is 1, this machine has 1 GPU \(devices 0 to 0\)$"):
        GpuSplit.of(draft_device=1).check_devices(1)
    with pytest.raises(OptionError, match=r"^tensor_parallel needs two or more GPUs"):
        GpuSplit.of(tensor_parallel=True).check_devices(1)
    with pytest.raises(OptionError, match=r"^tensor_parallel needs two or more GPUs"):
        GpuSplit.of("20", True).check_devices(2)
    for ok in (GpuSplit(), GpuSplit.of("20"), GpuSplit.of("auto")):
        ok.check_devices(1)
    GpuSplit.of("16,16", True, 1).check_devices(2)


def test_the_torch_backend_refuses_a_split(pair):
    from toolkit.runtime.factory import load_backend

    with pytest.raises(OptionError, match=r"^gpu_split needs --backend exllamav3 \(got split 16,16\)$"):
        load_backend("torch", *pair, split=GpuSplit.of("16,16"))
    with pytest.raises(OptionError, match=r"^draft_device needs --backend exllamav3 \(got drafter cuda:1\)$"):
        load_backend("torch", *pair, split=GpuSplit.of(draft_device=1))
    assert load_backend("torch", *pair, split=GpuSplit()).name == "torch"


# -- the per-device estimate -------------------------------------------------------------------------------

G = GIB
LAYERS, HEAD, DRAFT = [3 * G] * 8, 1 * G, 2 * G          # a target of 25 GiB (weights and caches), drafter 2 GiB


def test_layers_go_to_the_devices_in_order_up_to_each_budget():
    a, b = plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("16,16"), [80 * G, 80 * G])
    assert (a.layers, a.target, a.draft, a.budget) == ((0, 4), 15 * G, 2 * G, 16 * G)
    assert (b.layers, b.target, b.draft) == ((5, 7), 10 * G, 0)          # the LM head goes with the last layer
    assert a.total == 17.5 * G and b.total == 10.5 * G
    c, d = plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("16,16", draft_device=1), [80 * G, 80 * G])
    assert (c.draft, d.draft, d.total) == (0, 2 * G, 12.5 * G)


def test_one_gpu_default_and_a_split_onto_one_device():
    (a,) = plan_devices(LAYERS, HEAD, DRAFT, GpuSplit(), [80 * G])
    assert (a.target, a.draft, a.layers, a.total) == (25 * G, 2 * G, (0, 7), 27.5 * G)
    (b,) = plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("30"), [80 * G])
    assert (b.target, b.total) == (a.target, a.total)


def test_auto_budgets_the_free_memory_less_the_drafter():
    a, b = plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("auto"), [12.5 * G, 40 * G])
    assert a.budget == 10 * G and a.layers == (0, 2) and b.layers == (3, 7)      # 12.5 - 0.5 reserve - 2 drafter


def test_tensor_parallel_shares_in_proportion_to_the_split():
    a, b = plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("16,16", True), [80 * G, 80 * G])
    assert a.target == b.target == 12.5 * G and a.layers is None and a.draft == 2 * G
    a, b = plan_devices(LAYERS, HEAD, 0, GpuSplit.of("10,40", True), [80 * G, 80 * G])
    assert (a.target, b.target) == (5 * G, 20 * G)
    with pytest.raises(ToolkitError, match=r"^the target does not fit split 10,10, tensor-parallel: .* about 25\.0 GiB"
                                           r".*gives 20\.0 GiB \(cuda:0 10\.0, cuda:1 10\.0\)$"):
        plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("10,10", True), [80 * G, 80 * G])


def test_a_split_too_small_is_refused_with_what_each_device_got():
    with pytest.raises(ToolkitError, match=r"^the target does not fit split 8,8: 25\.0 GiB of weights and caches, "
                                           r"layer 4 has no room left \(cuda:0 6\.0 of 8\.0, cuda:1 6\.0 of 8\.0 GiB used\)$"):
        plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("8,8"), [80 * G, 80 * G])
    with pytest.raises(ToolkitError, match=r"its LM head has no room left"):
        plan_devices(LAYERS, 4 * G, DRAFT, GpuSplit.of("12,12"), [80 * G, 80 * G])
    with pytest.raises(OptionError, match="gpu_split lists 2 devices, this machine has 1 GPU"):
        plan_devices(LAYERS, HEAD, DRAFT, GpuSplit.of("16,16"), [80 * G])


def test_check_memory_refuses_per_device_against_free_memory(pair, monkeypatch):
    t, d = pair
    needs = check_memory(t, d, 4096, 4, "FakeGPU", GpuSplit.of("0.003,1"), free=[1 * G, 1 * G])
    assert needs[0].layers == (0, 0) and needs[1].layers == (1, 2) and needs[0].draft > 0 == needs[1].draft
    per, rest = layer_weight_bytes(t, 3)
    assert abs(sum(per) + rest - weight_bytes(t)) < 8 * 1024            # the headers' sizes: the files less headers
    assert sum(n.target for n in needs) == sum(per) + rest + 3 * 2 * 4 * 32 * 2 * 4096   # + K/V of 4096 tokens
    with pytest.raises(ToolkitError, match=r"^not enough GPU memory for split 0\.003,1: cuda:0 needs about 0\.5 GiB "
                                           r"\(target layers 0-0 0\.0, drafter 0\.0, reserve 0\.5\), 0\.2 free; "
                                           r"cuda:1 needs about 0\.5 GiB \(target layers 1-2 0\.0, .*\), 1\.0 free$"):
        check_memory(t, d, 4096, 4, "FakeGPU", GpuSplit.of("0.003,1"), free=[0.2 * G, 1 * G])
    install_loader(monkeypatch, 2, [1.0, 0.25])                        # the devices' own free memory
    with pytest.raises(ToolkitError, match=r"cuda:1 needs about 0\.5 GiB .* 0\.2 free$"):
        check_memory(t, d, 4096, 4, "FakeGPU", GpuSplit.of("0.003,1"))


# -- the load arguments, through the fake loader -----------------------------------------------------------


def load(pair, monkeypatch, devices, split, free=80.0):
    from toolkit.exl3.backend import Exl3Backend

    log = install_loader(monkeypatch, devices, free)
    be = Exl3Backend.from_dirs(*pair, cache_tokens=4096, max_concurrency=4, split=split)
    return be, log


@pytest.mark.parametrize("devices,split,draft_kw,target_kw", [
    (1, GpuSplit(), {}, {}),                                              # one GPU: the calls as they always were
    (1, GpuSplit.of("20"), {}, {"use_per_device": [20.0]}),
    (2, GpuSplit(), {"reserve_per_device": [0.5, -1]}, {"reserve_per_device": [0.5, -1]}),
    (2, GpuSplit.of("16,16"), {"reserve_per_device": [0.5, -1]}, {"use_per_device": [16.0, 16.0]}),
    (2, GpuSplit.of("auto"), {"reserve_per_device": [0.5, -1]}, {"reserve_per_device": [0.5, 0.5]}),
    (2, GpuSplit.of("16,16", True), {"reserve_per_device": [0.5, -1]}, {"use_per_device": [16.0, 16.0], "tensor_p": True}),
    (2, GpuSplit.of(tensor_parallel=True), {"reserve_per_device": [0.5, -1]}, {"reserve_per_device": [0.5, 0.5], "tensor_p": True}),
    (2, GpuSplit.of("16,16", draft_device=1), {"reserve_per_device": [-1, 0.5]}, {"use_per_device": [16.0, 16.0]}),
])
def test_load_arguments_per_split(pair, monkeypatch, devices, split, draft_kw, target_kw):
    be, log = load(pair, monkeypatch, devices, split)
    assert log == [("draft", {"progressbar": False, **draft_kw}, False),    # the drafter first, on its device
                   ("target", {"progressbar": False, **target_kw}, True)]   # the target told of the drafter
    assert be.split == split and be.cache.max_num_tokens == be.draft_cache.max_num_tokens == 4096


@pytest.mark.parametrize("cache_tokens,chunk", [(256, {"max_chunk_size": 256}), (768, {"max_chunk_size": 768}),
                                                (2048, {}), (4096, {})])
def test_a_small_cache_loads_with_the_chunk_cut_to_it(pair, monkeypatch, cache_tokens, chunk):
    """exllamav3 loads over a (1, max_chunk_size) batch shape in the cache (default 2048): the quantize speed step's
    one-job cache (a few hundred tokens) failed with "Cache too small for batch shape" before the chunk was cut."""
    from toolkit.exl3.backend import Exl3Backend

    log = install_loader(monkeypatch, 1)
    be = Exl3Backend.from_dirs(*pair, cache_tokens=cache_tokens, max_concurrency=1)
    assert log == [("draft", {"progressbar": False, **chunk}, False), ("target", {"progressbar": False, **chunk}, True)]
    assert be.cache.max_num_tokens == be.draft_cache.max_num_tokens == cache_tokens


def test_from_dirs_refuses_before_loading(pair, monkeypatch):
    from toolkit.exl3.backend import Exl3Backend

    log = install_loader(monkeypatch, 1)
    with pytest.raises(OptionError, match="gpu_split lists 2 devices, this machine has 1 GPU"):
        Exl3Backend.from_dirs(*pair, split=GpuSplit.of("16,16"))
    with pytest.raises(OptionError, match="draft_device is 1, this machine has 1 GPU"):
        Exl3Backend.from_dirs(*pair, split=GpuSplit.of(draft_device=1))
    log = install_loader(monkeypatch, 2, [0.2, 80])
    with pytest.raises(ToolkitError, match=r"not enough GPU memory for split 0\.003,1: cuda:0 .* 0\.2 free; cuda:1"):
        Exl3Backend.from_dirs(*pair, cache_tokens=4096, max_concurrency=4, split=GpuSplit.of("0.003,1"))
    assert log == []


def test_a_split_onto_one_device_decodes_unchanged(pair, monkeypatch):
    prompts = [[11, 12, 13], [40, 41], [60]]
    streams = []
    for split in (GpuSplit(), GpuSplit.of("20"), GpuSplit.of("auto")):
        be, log = load(pair, monkeypatch, 1, split)
        assert [name for name, _, _ in log] == ["draft", "target"]
        be.vocab_size = 97                                                # the fake generator's vocabulary
        rounds = {i: [] for i in range(len(prompts))}
        for i, r in be.generate_many(prompts, GenSettings(max_new_tokens=30, block_size=6)):
            rounds[i].append(r)
        streams.append({i: [(r.drafted, r.accepted, r.bonus, r.prefill, r.proposed) for r in rs]   # all but timings
                        for i, rs in rounds.items()})
        assert [tokens_of(rounds[i]) for i in rounds] == [ar_reference(p, 30, be.eos_ids) for p in prompts]
    assert streams[0] == streams[1] == streams[2]


# -- the commands pass the split on ------------------------------------------------------------------------


def test_bench_passes_the_split_and_refuses_it_on_torch(pair, monkeypatch, capsys):
    from toolkit import bench

    seen = {}

    def fake_load(name, target, draft, **kw):
        seen.update(kw, name=name)
        raise ToolkitError("stop here")

    monkeypatch.setattr(bench, "load_backend", fake_load)
    with pytest.raises(ToolkitError, match="stop here"):
        bench.main(["--backend", "exllamav3", "--gpu-split", "16,16", "--tensor-parallel", "--draft-device", "1"])
    assert seen["name"] == "exllamav3" and seen["split"] == GpuSplit((16.0, 16.0), True, 1)
    with pytest.raises(ToolkitError, match=r"^--gpu-split needs --backend exllamav3 \(got split 16,16\)$"):
        bench.main(["--gpu-split", "16,16"])
    with pytest.raises(ToolkitError, match=r"^--gpu-split must be auto or GB per device"):
        bench.main(["--backend", "exllamav3", "--gpu-split", "16,-1"])


def test_quantize_places_an_exl3_target_by_the_split(tmp_path, pair, monkeypatch):
    import test_quantize_fakes as fakes
    from test_quantize_exl3 import run

    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    splits = []
    for name in ("open_target", "open_backend"):
        inner = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, split=None, _f=inner, **k: splits.append(split) or _f(*a, **k))
    monkeypatch.setattr(engine, "free_bytes", lambda split=None: splits.append(("free", split)) or engine.free)
    exl3 = fakes.exl3_target(pair[0], tmp_path / "tiny-exl3", bits=4.0)
    want = GpuSplit((16.0, 16.0), False, 1)
    run(tmp_path, pair, exl3, bits="8", calibrate=False, gpu_split="16,16", draft_device=1)
    # the target step's load, then speed's one load (with the BF16 drafter; 8 bpw is swapped into it, keeping it)
    assert ("free", want) in splits and [s for s in splits if s != ("free", want)] == [want] * 2
    assert "swap:bf16-reference->8.0bpw" in engine.events
    with pytest.raises(OptionError, match=r"^gpu_split places an EXL3 target on exllamav3 \(got split 16,16\); "
                                          r"this run loads a transformers target$"):
        run(tmp_path, pair, pair[0], out="out-hf", bits="8", calibrate=False, gpu_split="16,16")


def test_generate_and_eval_tau_pass_the_split(pair, monkeypatch, tmp_path):
    from toolkit import eval_tau, generate

    seen = []

    def fake_load(name, target, draft=None, **kw):         # eval_tau passes the pair it read (factory.read_pair)
        seen.append((name, kw["split"]))
        raise ToolkitError("stop here")

    monkeypatch.setattr(generate, "load_backend", fake_load)
    monkeypatch.setattr(eval_tau, "load_backend", fake_load)
    args = ["--backend", "exllamav3", "--gpu-split", "auto", "--draft-device", "1"]
    with pytest.raises(ToolkitError, match="stop here"):
        generate.main(["--prompt", "hi", *args])
    with pytest.raises(ToolkitError, match="stop here"):
        eval_tau.main(["--target", str(pair[0]), "--draft", str(pair[1]), "--heldout", str(write_heldout(tmp_path)), *args])
    assert seen == [("exllamav3", GpuSplit("auto", False, 1))] * 2
    with pytest.raises(ToolkitError, match=r"^--draft-device must be from 0 to 1023, got -1$"):
        generate.main(["--prompt", "hi", "--draft-device", "-1"])


def write_heldout(folder):
    import json

    p = folder / "heldout.json"
    p.write_text(json.dumps({"chat": ["hello"]}))
    return p


# -- the app and the Space ---------------------------------------------------------------------------------


def test_app_spec_takes_the_split_from_env_then_space_json():
    from toolkit.app.models import ModelSpec

    assert ModelSpec.resolve(env={}).split.default
    d = {"gpu_split": "16,16", "tensor_parallel": True, "draft_device": 1}
    assert ModelSpec.resolve(env={}, defaults=d).split == GpuSplit((16.0, 16.0), True, 1)
    env = {"DFLASH_GPU_SPLIT": "auto", "DFLASH_TENSOR_PARALLEL": "0", "DFLASH_DRAFT_DEVICE": "0"}
    assert ModelSpec.resolve(env=env, defaults=d).split == GpuSplit("auto")
    with pytest.raises(OptionError, match="gpu_split must be auto"):
        ModelSpec.resolve(env={"DFLASH_GPU_SPLIT": "lots"})


def test_app_passes_the_split_to_exllamav3_and_refuses_it_on_torch(monkeypatch):
    from toolkit.app import models
    from toolkit.app.models import Hardware, ModelSpec, load

    calls = []

    def opener(name, target, draft, device, **kw):
        calls.append((name, kw))
        raise ToolkitError("stop here")

    monkeypatch.setattr(models, "fetch_model", lambda ref, what: (ref, ref))
    monkeypatch.setattr(models.backend_class(models.gpu_backend()), "installed", classmethod(lambda cls: True))     # exllamav3 "installed"
    hw = Hardware(cuda=True)
    assert "stop here" in load(ModelSpec("t", "d", "exllamav3", split=GpuSplit.of("16,16")), hw, opener).error
    assert calls == [("exllamav3", {"split": GpuSplit.of("16,16")})]
    out = load(ModelSpec("t", "d", "torch", split=GpuSplit.of("16,16")), hw, opener)
    assert out.error == ("Could not load the models: the GPU split (split 16,16) needs the exllamav3 backend; "
                         "this runs torch") and len(calls) == 1
    load(ModelSpec("t", "d", "torch"), hw, opener)
    assert calls[-1] == ("torch", {})                                      # no split: the call as before


def test_space_export_writes_the_split_and_checks_the_hardware(tmp_path):
    import json

    from toolkit.app.models import ModelSpec
    from toolkit.hub import space

    out = space.export(space.ExportOptions(str(tmp_path / "sp"), hardware="l4x4", gpu_split="12,12", draft_device=1,
                                           exllamav3_jit=True))
    cfg = json.loads((out / "space.json").read_text())
    assert cfg == {"target": None, "draft": None, "backend": "auto", "gpu_split": "12,12", "draft_device": 1}
    assert ModelSpec.resolve(env={}, defaults=cfg).split == GpuSplit((12.0, 12.0), False, 1)
    assert "DFLASH_GPU_SPLIT" in (out / "README.md").read_text()
    with pytest.raises(OptionError, match=r"^gpu_split lists 2 devices, hardware l4x1 has 1 GPU$"):
        space.export(space.ExportOptions(str(tmp_path / "sp2"), hardware="l4x1", gpu_split="12,12"))
    with pytest.raises(OptionError, match=r"^tensor_parallel needs --backend exllamav3"):
        space.export(space.ExportOptions(str(tmp_path / "sp3"), hardware="cpu-basic", tensor_parallel=True))
    assert not (tmp_path / "sp2").exists() and not (tmp_path / "sp3").exists()


def test_a_target_loads_for_the_longest_forward_it_runs(pair, monkeypatch):
    """The quantize target step's load (exl3_taps.open_target, max_chunk): exllamav3 measures a forward of that many
    tokens, not 2048, and the Generator prefills no more at once; without it, or at 2048 and up, as always."""
    from exl3_fakes import FakeGenerator

    from toolkit.exl3 import taps as exl3_taps
    from toolkit.exl3.backend import Exl3Backend
    from toolkit.runtime.factory import load_backend

    log = install_loader(monkeypatch, 1)
    monkeypatch.setattr(exl3_taps, "check_installed", lambda: None)
    monkeypatch.setattr(exl3_taps, "Exl3Target", lambda backend, batch: argparse.Namespace(backend=backend))
    t = exl3_taps.open_target(pair[0], 8192, 8, max_chunk=768)
    assert log == [("target", {"progressbar": False, "max_chunk_size": 768}, False)]
    t.backend.generator(0)
    assert FakeGenerator.built[-1].options == {"max_chunk_size": 768}
    for chunk in (None, 2048, 4096):
        be = Exl3Backend.from_dirs(pair[0], cache_tokens=8192, max_concurrency=8, max_chunk=chunk)
        be.generator(0)
        assert log[-1] == ("target", {"progressbar": False}, False) and FakeGenerator.built[-1].options == {}
    be = Exl3Backend.from_dirs(pair[0], cache_tokens=512, max_concurrency=1, max_chunk=768)     # the cache is less
    be.generator(0)
    assert log[-1][1]["max_chunk_size"] == 512 == FakeGenerator.built[-1].options["max_chunk_size"]
    with pytest.raises(ToolkitError, match=r"^max_chunk must be a positive multiple of 256, got 700$"):
        Exl3Backend.from_dirs(pair[0], cache_tokens=8192, max_concurrency=8, max_chunk=700)
    with pytest.raises(ToolkitError, match=r"^max_chunk is an exllamav3 load option"):
        load_backend("torch", pair[0], max_chunk=768)
