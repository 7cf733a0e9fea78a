"""The app's start: which backend runs the demo where, the page title, and the console's steps and request lines."""

from __future__ import annotations

import html
from pathlib import Path

import pytest

pytest.importorskip("gradio")

from app_fakes import FakeBackend  # noqa: E402

from toolkit.app import models  # noqa: E402
from toolkit.app.handlers import ChatHandler  # noqa: E402
from toolkit.app.models import Hardware, Loaded, ModelSpec, choose_backend, load  # noqa: E402
from toolkit.app.ui import build_app, title_of  # noqa: E402


def test_demo_runs_on_exllamav3_on_a_cuda_gpu(monkeypatch):
    monkeypatch.setattr(models.backend_class(models.gpu_backend()), "installed", classmethod(lambda cls: True))      # exllamav3 "installed"
    assert choose_backend(ModelSpec(), Hardware(cuda=True))[:2] == ("exllamav3", "cuda")
    assert choose_backend(ModelSpec(), Hardware(cuda=False))[:2] == ("torch", "cpu")
    monkeypatch.setattr(models.backend_class(models.gpu_backend()), "installed", classmethod(lambda cls: False))
    assert choose_backend(ModelSpec(), Hardware(cuda=True))[:2] == ("torch", "cuda")    # no exllamav3: torch, on the GPU


def test_smollm2_demo_is_padded_for_exllamav3_and_the_tiny_pair_falls_back(monkeypatch, tmp_path):
    padded = []

    def fake_pad(src, dst, force=False):
        Path(dst).mkdir(parents=True)
        (Path(dst) / "config.json").write_text("{}")
        padded.append((src, dst))

    import toolkit.assets.padding as padding

    monkeypatch.setattr(padding, "pad", fake_pad)
    target, draft = tmp_path / "smollm2-135m-instruct", tmp_path / "drafter"

    def smollm2(out):
        out.demo_kind = "smollm2"
        return str(target), str(draft)

    monkeypatch.setattr(models, "pick_demo", smollm2)
    out = Loaded(None, backend_name="exllamav3", device="cuda", hardware=Hardware(cuda=True))
    t, d = models.demo_pair(out)
    assert Path(t).parent == Path(d).parent == tmp_path / "smollm2-135m-instruct-exllamav3" and len(padded) == 2
    assert models.demo_pair(out) == (t, d) and len(padded) == 2                  # made once, then reused

    def tiny(out):
        out.demo_kind = "tiny"
        return "t", "d"

    monkeypatch.setattr(models, "pick_demo", tiny)
    out = Loaded(None, backend_name="exllamav3", device="cuda", hardware=Hardware(cuda=True))
    assert models.demo_pair(out) == ("t", "d") and (out.backend_name, out.device) == ("torch", "cuda")
    assert "torch backend" in out.notes[0]


def test_title_names_the_backend_in_use():
    be = FakeBackend()
    cpu = Loaded(be, backend_name="torch", device="cpu")
    assert title_of(cpu) == "DFlash speculative decoding on PyTorch (CPU)"
    assert title_of(Loaded(be, backend_name="exllamav3", device="cuda")).endswith("on ExLlamaV3 (GPU)")
    assert title_of(Loaded(be, backend_name="torch", device="cuda:1")).endswith("on PyTorch (CUDA)")
    assert "ExLlamaV3" not in build_app(cpu).title


def test_start_names_each_step_with_its_time(capsys, tmp_path):
    loaded = load(ModelSpec(target=str(tmp_path), draft=str(tmp_path)), Hardware(),
                  opener=lambda *a, **k: FakeBackend(step_s=0))
    assert loaded.error is None and list(loaded.steps) == ["prepare", "load", "calibrate", "warm-up"]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[app] ")]
    for name, line in zip(loaded.steps, lines[-4:]):
        assert line.startswith(f"[app] {name}: ") and line.endswith(" s)")


def test_one_console_line_per_request(capsys):
    h = ChatHandler(Loaded(FakeBackend(step_s=0)))
    for _ in h.respond("hi", [], 16, 60, 0.0, 0, "", False):
        pass
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[app] request: 2 prompt tokens, block 16, 60 tokens in") and "x (" in line
    for _ in h.respond("hi", [], 16, 20, 0.0, 0, "", False):                # 2 drafted rounds: too few for a ratio
        pass
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("20 tokens in 2 rounds, 2 drafted, too few for a ratio: no ratio")
    for _ in h.respond("hi", [], 1 + 1, 3, 0.0, 0, "", False):
        pass
    gen = h.respond("hi", [], 16, 200, 0.0, 0, "", False)
    next(gen), next(gen)
    gen.close()                                                       # the client left mid-answer
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("the client left before the end: no ratio")
    ar_only = ChatHandler(Loaded(FakeBackend(step_s=0, block_size=1)))
    outs = list(ar_only.respond("hi", [], "auto", 12, 0.0, 0, "", False))
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("all plain AR (no round drafted): no ratio")
    assert "No speedup to report" in html.unescape(outs[-1][2])


def test_gguf_is_parsed_once_while_converting(tmp_path):
    """The demo's first start reads SmolLM2's GGUF once, not three times (the same files come out: checked by
    converting with and without it, both byte-identical)."""
    gguf = pytest.importorskip("gguf")
    from toolkit.assets.smollm2 import one_gguf_parse

    made = []
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with one_gguf_parse():
        a, b = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        made.append(a is b)
        arch = next(iter(gguf.MODEL_ARCH_NAMES))
        made.append(gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2))
    assert made == [True, True] and (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, names)
