"""Checkpoint loading errors: each is one line naming the problem, and a failed save leaves nothing behind."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.dflash import load_drafter, save_drafter
from toolkit.core.errors import ToolkitError
from toolkit.assets.fixtures import drafter_config, random_drafter


@pytest.fixture
def folder(tmp_path):
    m = random_drafter(drafter_config(16, [0, 1], 5, 4, vocab_size=32, window=8))
    return save_drafter(m, tmp_path / "draft", dtype=torch.float32)


def one_line(e):
    assert "\n" not in str(e.value)
    return str(e.value)


def test_round_trip(folder):
    m = load_drafter(folder)
    again = load_drafter(save_drafter(m, folder.parent / "again", dtype=torch.float32))
    for (k, a), (_, b) in zip(m.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_missing_tensor(folder):
    sd = load_file(folder / "model.safetensors")
    del sd["layers.1.mlp.down_proj.weight"]
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "missing tensor 'layers.1.mlp.down_proj.weight'" in one_line(e)


def test_wrong_shape(folder):
    sd = load_file(folder / "model.safetensors")
    sd["fc.weight"] = torch.zeros(16, 48)
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "'fc.weight' has shape (16, 48), expected (16, 32)" in one_line(e)


def test_truncated_safetensors(folder):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "not a readable safetensors file" in one_line(e)


def test_not_safetensors(folder):
    (folder / "model.safetensors").write_text("this is not a tensor file")
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "model.safetensors" in one_line(e)


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(ToolkitError, match=r"no \*\.safetensors files"):
        load_drafter(folder)


def test_unknown_architecture(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["EagleDraftModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "['EagleDraftModel']" in one_line(e) and "DFlashDraftModel" in str(e.value)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    """A full disk while writing a checkpoint: one line naming the folder and the bytes needed, nothing left behind."""
    from safetensors import SafetensorError

    m = random_drafter(drafter_config(16, [0, 1], 5, 4, vocab_size=32, window=8))

    def full_disk(*a, **k):     # what safetensors raises on ENOSPC (seen on a 64 KiB tmpfs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(ToolkitError, match=r"^no space left on the device writing .*/out: about 0\.0 MiB needed"):
        save_drafter(m, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_over_an_old_one_keeps_it_on_a_full_disk(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    m = random_drafter(drafter_config(16, [0, 1], 5, 4, vocab_size=32, window=8))
    out = save_drafter(m, tmp_path / "ckpt", dtype=torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(ToolkitError, match="no space left"):
        save_drafter(m, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]             # no .ckpt.* temp folder left


def test_mask_embedding_is_used(folder):
    sd = load_file(folder / "model.safetensors")
    sd["mask_embedding"] = torch.full((16,), 0.5)
    save_file(sd, folder / "model.safetensors")
    m = load_drafter(folder)
    x = m.embed_block(torch.tensor([3]), torch.randn(32, 16))
    assert (x[0, 1:] == 0.5).all() and not (x[0, 0] == 0.5).all()


# --- strict loading of a target (torch backend) and of the kinds of folders -------------------------------------

@pytest.fixture
def target(tmp_path, pair):
    import shutil

    return shutil.copytree(pair[0], tmp_path / "target")


def edit_tensors(folder, fn):
    sd = load_file(folder / "model.safetensors")
    fn(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def load_target(folder):
    from toolkit.runtime.hf import load_hf_model

    return load_hf_model(folder, what="--target")


def test_target_loads_strictly_when_complete(target):
    assert load_target(target).lm_head.weight.abs().sum() > 0


@pytest.mark.parametrize("edit,msg", [
    (lambda sd: sd.pop("lm_head.weight"), "lacks tensor 'lm_head.weight'"),
    (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda sd: sd.update({"model.extra.weight": torch.zeros(2)}), "has tensor 'model.extra.weight'"),
    (lambda sd: sd.update({"lm_head.weight": torch.zeros(7, 128)}), "tensor 'lm_head.weight' has shape (7, 128)"),
    (lambda sd: sd.update({"model.layers.0.mlp.up_proj.trellis": torch.zeros(2, dtype=torch.int16)}), "holds EXL3 tensors"),
])
def test_target_with_a_wrong_tensor_is_refused_naming_it(target, edit, msg):
    edit_tensors(target, edit)
    with pytest.raises(ToolkitError) as e:
        load_target(target)
    assert one_line(e).startswith("--target: ") and msg in str(e.value)


def test_tied_target_needs_no_lm_head(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                               num_hidden_layers=1, vocab_size=50, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "tied"))
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    m = load_target(tmp_path / "tied")
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_truncated_target_is_refused(target):
    f = target / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ToolkitError) as e:
        load_target(target)
    assert one_line(e).startswith("--target: ") and "model.safetensors" in str(e.value) and "truncated" in str(e.value)


def test_missing_shard_of_an_index_is_refused(target):
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ToolkitError, match="model-00002-of-00002.safetensors"):
        load_target(target)


def mark_exl3(folder) -> None:
    """Make a model folder's config.json say it is an EXL3 checkpoint at 4.0 bpw."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "bits": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_exl3_folder_is_named_for_the_torch_backend(target):
    mark_exl3(target)
    with pytest.raises(ToolkitError) as e:
        load_target(target)
    assert "is an EXL3 checkpoint" in one_line(e) and "--backend exllamav3" in str(e.value)


def test_drafter_given_as_target_and_target_as_draft_are_named(pair):
    t, d = pair
    with pytest.raises(ToolkitError) as e:
        load_target(d)
    assert "is a DFlash drafter, not a target model" in one_line(e)
    with pytest.raises(ToolkitError) as e:
        load_drafter(t)
    assert "--draft: " in one_line(e) and "is an HF model (LlamaForCausalLM), not a DFlash drafter" in str(e.value)
    from toolkit.dflash import DFlashConfig

    with pytest.raises(ToolkitError, match="is an HF model"):
        DFlashConfig.from_dir(t)
    with pytest.raises(ToolkitError, match="target folder is a DFlash drafter"):
        DFlashConfig.from_dir(d).validate_against(json.loads((d / "config.json").read_text()))


def test_exl3_drafter_is_refused_by_the_reference_loader(folder):
    mark_exl3(folder)
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "is an EXL3 checkpoint of a DFlash drafter" in one_line(e) and "unquantized drafter" in str(e.value)


def test_unexpected_drafter_tensor_is_refused(folder):
    edit_tensors(folder, lambda sd: sd.update({"lm_head.weight": torch.zeros(32, 16)}))
    with pytest.raises(ToolkitError) as e:
        load_drafter(folder)
    assert "unexpected tensor 'lm_head.weight'" in one_line(e)


def write_raw(path, header, data=b""):
    import struct

    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("header,msg", [
    ([1, 2], "the header is a JSON list, not an object"),
    ({"w": {"dtype": "F32", "shape": [2]}}, "entry 'w': data_offsets must be [begin, end]"),
    ({"w": [1]}, "entry 'w' is a JSON list"),
    ({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, "entry 'w': shape must be a list"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "F32 [4] needs 16 bytes, data_offsets cover 8"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "truncated: needs"),
    ({"__metadata__": [1]}, "__metadata__ is not an object"),
])
def test_malformed_headers_are_one_line_naming_file_and_entry(tmp_path, header, msg):
    from toolkit.core.tensorfiles import read_header
    from toolkit.quant.validate import read_headers

    f = tmp_path / "model.safetensors"
    write_raw(f, header)
    for read in (lambda: read_header(f), lambda: read_headers(tmp_path), lambda: load_drafter_of(tmp_path)):
        with pytest.raises(ToolkitError) as e:
            read()
        assert str(f) in one_line(e) and msg in str(e.value)


def load_drafter_of(folder):
    from toolkit.dflash import read_tensors

    return read_tensors(folder)


def test_loaded_weights_are_the_files_and_no_random_init_runs(folder, monkeypatch):
    """load_drafter fills a meta-device skeleton (DFlashDraft.skeleton) with the file's tensors: every parameter is
    the file's value, on the CPU, trainable, and initializers run only on meta tensors (no work; 3.8 s for the
    upstream shape when they filled real ones)."""
    from toolkit.dflash import DFlashDraft, DFlashConfig

    assert {p.device.type for p in DFlashDraft.skeleton(DFlashConfig.from_dir(folder)).parameters()} == {"meta"}
    ran = []
    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        real = getattr(torch.nn.init, name)
        monkeypatch.setattr(torch.nn.init, name, lambda *a, real=real, **k: ran.append(
            (a[0] if a else k["tensor"]).device.type) or real(*a, **k))
    m = load_drafter(folder)
    assert ran and set(ran) == {"meta"}
    want = load_file(folder / "model.safetensors")
    got = m.state_dict()
    assert set(got) <= {k.removeprefix("model.") for k in want}
    assert all(torch.equal(v, want.get(k, want.get(f"model.{k}"))) for k, v in got.items())
    assert all(p.device.type == "cpu" and p.requires_grad for p in m.parameters())


def with_spans(src, dst, edit):
    """A copy of the safetensors file `src` whose header's spans `edit` changes (the data stays as it is); the
    name of the tensor it moved."""
    import struct

    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    moved = edit(header)
    write_raw(dst, header, raw[8 + n:])
    return moved


def second(h):
    return sorted((v["data_offsets"][0], k) for k, v in h.items() if k != "__metadata__")[1][1]


def overlap(h):                         # the second tensor moved 4 bytes back, into the first
    k = second(h)
    h[k]["data_offsets"] = [o - 4 for o in h[k]["data_offsets"]]
    return k


def gap(h):                             # every tensor from the second on moved 8 bytes on, past the data's end
    start = h[second(h)]["data_offsets"][0]
    for v in h.values():
        if isinstance(v, dict) and "data_offsets" in v and v["data_offsets"][0] >= start:
            v["data_offsets"] = [o + 8 for o in v["data_offsets"]]
    return max((v["data_offsets"][1], k) for k, v in h.items() if k != "__metadata__")[1]


def huge(h):                            # a span of 2^70 bytes, its shape to match
    k = second(h)
    h[k].update(dtype="U8", shape=[2**70], data_offsets=[h[k]["data_offsets"][0], h[k]["data_offsets"][0] + 2**70])
    return k


@pytest.mark.parametrize("edit,msg", [(overlap, "overlaps tensor"), (gap, "truncated: needs"),
                                      (huge, "truncated: needs")])
def test_bad_spans_are_one_line_naming_the_file_and_the_tensor(tmp_path, capsys, edit, msg):
    """Spans that overlap, run past the end or are huge are refused by the one reader (core.tensorfiles) and by every
    command that opens a drafter: pad, generate, the quantize checks and push, never a SafetensorError traceback."""
    import shutil

    from toolkit.core.errors import run_cli
    from toolkit.core.tensorfiles import iter_tensors, load_tensors, read_header

    pair = __import__("pathlib").Path(__file__).parents[1] / "toolkit" / "data" / "tiny_pair"
    draft = tmp_path / "draft"
    shutil.copytree(pair / "draft", draft)
    f = draft / "model.safetensors"
    name = with_spans(pair / "draft" / "model.safetensors", f, edit)
    from toolkit.hub.push import check_weights
    from toolkit.quant.validate import check_finite_weights

    for read in (lambda: read_header(f), lambda: load_tensors(f), lambda: list(iter_tensors(f)),
                 lambda: load_drafter(draft), lambda: check_weights(f), lambda: check_finite_weights(draft)):
        with pytest.raises(ToolkitError) as e:
            read()
        assert str(f) in one_line(e) and msg in str(e.value) and repr(name) in str(e.value), str(e.value)
    from toolkit import generate, pad

    for main, argv in ((pad.main, [str(draft), str(tmp_path / "out")]),
                       (generate.main, ["--target", str(pair / "target"), "--draft", str(draft), "--prompt", "hi"])):
        capsys.readouterr()
        with pytest.raises(SystemExit) as code:
            run_cli(lambda: main(argv))
        err = capsys.readouterr().err
        assert code.value.code == 2 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("error: ") and repr(name) in err and str(f) in err, err
    assert not (tmp_path / "out").exists()


def test_gaps_and_bytes_after_the_last_tensor_are_refused(tmp_path):
    from toolkit.core.tensorfiles import read_header

    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for header, data, msg in (({"a": a, "b": {**a, "data_offsets": [12, 20]}}, 20, "starts at byte 12, leaving bytes 8 to 12"),
                              ({"a": a}, 16, "8 bytes after the last tensor ('a') belong to no tensor")):
        write_raw(tmp_path / "m.safetensors", header, bytes(data))
        with pytest.raises(ToolkitError) as e:
            read_header(tmp_path / "m.safetensors")
        assert msg in one_line(e)
