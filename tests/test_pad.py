"""toolkit.assets.padding: a zero-padded copy computes the same logits, and every width is 128-aligned."""

import json

import pytest
import torch

from toolkit.core.errors import ToolkitError
from toolkit.assets.padding import pad, padded_widths


def smol_like(tmp_path, layers=2):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               intermediate_size=1536, num_hidden_layers=layers, vocab_size=300, tie_word_embeddings=True,
                               rms_norm_eps=1e-5, max_position_embeddings=256)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(str(tmp_path / "src"))
    return m


def test_widths_of_smollm2():
    a, b = padded_widths({"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                          "head_dim": 64, "intermediate_size": 1536})
    assert (b.hidden, b.heads, b.kv_heads, b.head_dim, b.intermediate) == (768, 12, 4, 64, 1536)
    assert b.heads // b.kv_heads == a.heads // a.kv_heads                      # GQA grouping kept


def test_padded_model_computes_the_same(tmp_path):
    from transformers import AutoModelForCausalLM

    m = smol_like(tmp_path)
    out = pad(str(tmp_path / "src"), str(tmp_path / "dst"))
    cfg = json.loads((out / "config.json").read_text())
    assert all(cfg[k] % 128 == 0 for k in ("hidden_size", "intermediate_size"))
    assert cfg["num_key_value_heads"] * cfg["head_dim"] % 128 == 0 and cfg["padded_from"]["hidden_size"] == 576
    p = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        a, b = m(input_ids=ids).logits, p(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert not list(tmp_path.glob(".dst.*"))                                  # no temp dir left behind


def test_refuses_other_families(tmp_path):
    with pytest.raises(ToolkitError, match="dense"):
        padded_widths({"model_type": "qwen3_5_moe", "hidden_size": 64})


def test_padded_pair_decodes_the_same(tmp_path):
    """A drafter padded alongside its target drafts the same blocks: same tokens and same rounds, fp32 on CPU."""
    from toolkit.dflash import save_drafter
    from toolkit.assets.fixtures import copy_tokenizer, drafter_config, random_drafter
    from toolkit.runtime.backend import GenSettings
    from toolkit.runtime.torch_backend import TorchBackend

    smol_like(tmp_path, layers=3)
    special = copy_tokenizer(tmp_path / "src")
    d = drafter_config(576, [0, 1], special["mask"], 8, layers=2, vocab_size=300, target_layers=3, intermediate=256)
    d.update(num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    save_drafter(random_drafter(d, 0, std=0.05), tmp_path / "draft", dtype=torch.float32)
    pt, pd = pad(str(tmp_path / "src"), str(tmp_path / "t2")), pad(str(tmp_path / "draft"), str(tmp_path / "d2"))
    assert json.loads((pd / "config.json").read_text())["hidden_size"] == 768
    st = GenSettings(max_new_tokens=24, block_size=8)
    a = list(TorchBackend.from_dirs(tmp_path / "src", tmp_path / "draft").generate([5, 6, 7, 8], st))
    b = list(TorchBackend.from_dirs(pt, pd).generate([5, 6, 7, 8], st))
    assert [(r.drafted, r.accepted, r.bonus) for r in a] == [(r.drafted, r.accepted, r.bonus) for r in b]


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    smol_like(tmp_path, layers=1)

    def full_disk(*a, **k):     # what safetensors raises on ENOSPC (seen on a 64 KiB tmpfs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(ToolkitError, match=r"^no space left on the device writing .*/dst: about [0-9.]+ MiB needed, "):
        pad(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_rerun_replaces_its_own_output_and_refuses_other_folders(tmp_path):
    from toolkit.core.errors import OptionError

    smol_like(tmp_path, layers=1)
    first = pad(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert pad(str(tmp_path / "src"), str(tmp_path / "dst")) == first           # its own earlier output: no --force
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OptionError, match="is not an earlier output of pad"):
        pad(str(tmp_path / "src"), str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(OptionError, match="SRC itself or inside it"):
        pad(str(tmp_path / "src"), str(tmp_path / "src" / "sub"))


def test_exl3_and_truncated_sources_are_refused(tmp_path):
    from toolkit.core.errors import OptionError

    smol_like(tmp_path, layers=1)
    f = tmp_path / "src" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(OptionError, match="src: .*model.safetensors: not a readable safetensors file \\(truncated"):
        pad(str(tmp_path / "src"), str(tmp_path / "dst"))
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "exl3"}}))
    with pytest.raises(OptionError, match="is an EXL3 checkpoint"):
        pad(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
