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
