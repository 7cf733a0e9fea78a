"""folders.atomic_dir, which every command that writes a model folder goes through: all or nothing, readable."""

import stat

import pytest

from toolkit.core.errors import ToolkitError
from toolkit.core.folders import atomic_dir


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


def test_claim_refuses_before_any_work_what_the_command_does_not_own(tmp_path, monkeypatch):
    from toolkit.core.errors import OptionError
    from toolkit.core.folders import claim, mark

    monkeypatch.chdir(tmp_path)
    assert claim(tmp_path / "new" / "deeper", "pad", False) == tmp_path / "new" / "deeper"     # missing: fine
    (tmp_path / "f").write_text("x")
    with pytest.raises(OptionError, match=r"^out: .*/f exists and is not a folder$"):
        claim(tmp_path / "f", "pad", True)
    with pytest.raises(OptionError, match=r"is under .*/f, which is a file$"):
        claim(tmp_path / "f" / "x", "pad", False)
    for here in (".", str(tmp_path), str(tmp_path.parent)):
        with pytest.raises(OptionError, match="is the current folder, one above it or the home folder"):
            claim(here, "pad", True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a").write_text("x")
    with pytest.raises(OptionError, match=r"^dst: .*/mine exists and is not empty, and is not an earlier output of pad "
                                          r"\(pass --force to replace it once the new output is complete\)$"):
        claim(mine, "pad", False, field="dst")
    claim(mine, "pad", True)                                           # forced: fine
    mark(mine, "pad")
    claim(mine, "pad", False)                                          # its own earlier output: fine
    with pytest.raises(OptionError, match="not an earlier output of bench"):
        claim(mine, "bench", False)                                    # another command's output is not its own


def test_claim_refuses_an_unwritable_place(tmp_path):
    import os

    from toolkit.core.errors import OptionError
    from toolkit.core.folders import claim

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(OptionError, match="cannot write in"):
            claim(ro / "out", "pad", False)
    finally:
        os.chmod(ro, 0o755)


def test_atomic_writers_turn_a_full_disk_into_one_line_and_leave_nothing(tmp_path, monkeypatch):
    import errno
    import io
    import os

    from toolkit.core.folders import atomic_file, owner

    with atomic_dir(tmp_path / "m", command="pad") as tmp:
        (tmp / "w").write_text("x")
    assert owner(tmp_path / "m") == "pad"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ToolkitError, match=r"^no space left on the device writing .*/n: about 1.0 MiB needed, [0-9.]+ MiB free$"):
        with atomic_dir(tmp_path / "n", need=2**20) as tmp:
            full()
    class Full(io.BytesIO):
        def write(self, b):
            full()

    monkeypatch.setattr("toolkit.core.folders.os.fdopen", lambda fd, mode: (os.close(fd), Full())[1])
    with pytest.raises(ToolkitError, match=r"^no space left on the device writing .*/r.json"):
        atomic_file(tmp_path / "r.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# Each writer of core.folders, killed (SIGKILL) as its temp appears or just before its rename, then run again.
WRITERS = {
    "atomic_write": "atomic_write(OUT / 'w.bin', lambda f: f.write(b'new'))",
    "atomic_file": "atomic_file(OUT / 'w.json', '{}')",
    "atomic_dir": "with atomic_dir(OUT / 'model', command='pad') as tmp: (tmp / 'config.json').write_text('{}')",
    "mark": "mark(OUT, 'pad')",
}


@pytest.mark.parametrize("moment", ["appear", "written"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_killed_writer_leaves_nothing_after_the_next_run(tmp_path, writer, moment):
    import subprocess
    import sys
    from pathlib import Path

    from toolkit.core import folders

    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]\n"
            "from pathlib import Path\nimport killhook\n"
            f"OUT = Path({str(tmp_path)!r}); killhook.arm(OUT, {moment!r})\n"
            "from toolkit.core.folders import atomic_dir, atomic_file, atomic_write, mark\n" + WRITERS[writer])
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    left = [p.name for p in tmp_path.iterdir() if folders.TEMP.match(p.name)]
    assert left, "the kill left no temp entry: the test would prove nothing"
    env = {"OUT": tmp_path, "atomic_dir": folders.atomic_dir, "atomic_file": folders.atomic_file,
           "atomic_write": folders.atomic_write, "mark": folders.mark}
    exec(compile(WRITERS[writer], writer, "exec"), env)          # the next run of the same writer
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [{"atomic_write": "w.bin", "atomic_file": "w.json", "atomic_dir": "model",
                      "mark": folders.MARKER}[writer]], names
