"""folders.atomic_dir, which every command that writes a model folder goes through: all or nothing, readable."""

import stat

import pytest

from toolkit.core.errors import ToolkitError
from toolkit.core.folders import atomic_dir, check_out


def test_new_folder_appears_whole_and_readable(tmp_path):
    out = tmp_path / "a" / "model"
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
        assert not out.exists()                      # nothing at the final path until the block ends
    assert (out / "config.json").read_text() == "{}"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]


def test_failure_keeps_the_old_folder_and_leaves_no_temp(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(out) as tmp:
            (tmp / "half.txt").write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and [p.name for p in out.iterdir()] == ["old.txt"]


def test_success_replaces_the_old_folder(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_save_drafter_writes_through_it(tmp_path):
    import torch

    from toolkit.dflash import save_drafter
    from toolkit.assets.fixtures import drafter_config, random_drafter

    d = save_drafter(random_drafter(drafter_config(16, [0], 5, 4, vocab_size=64, target_layers=2)), tmp_path / "d",
                     dtype=torch.float32)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755 and (d / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_check_out_refuses_a_file_and_a_full_folder_unless_forced(tmp_path):
    check_out(tmp_path / "new", "--out ", False, "--overwrite")          # missing: fine
    (tmp_path / "f").write_text("x")
    with pytest.raises(ToolkitError, match=r"^dir: .*/f exists and is not a folder$"):
        check_out(tmp_path / "f", "dir: ", True, "--force")
    (tmp_path / "d").mkdir()
    check_out(tmp_path / "d", "--out ", False, "--overwrite")            # empty: fine
    (tmp_path / "d" / "a").write_text("x")
    with pytest.raises(ToolkitError, match=r"^--out .*/d exists and is not empty \(pass --overwrite to replace it\)$"):
        check_out(tmp_path / "d", "--out ", False, "--overwrite")
    check_out(tmp_path / "d", "--out ", True, "--overwrite")
