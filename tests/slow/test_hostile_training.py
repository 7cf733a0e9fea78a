"""The training outputs under hostile conditions: a folder it does not own, a rerun, a second run on the same folder
(its lock), non-finite weights (never loaded or written, never converted), a diverging run, and a full disk (a
small tmpfs) in training and in quantize: one error line, and no partial file left."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_quantize_fakes as quantize_fakes
import toolkit.train.trainer as td
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.core.folders import owner
from toolkit.train.optim import Divergence, optimize

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
SMALL = dict(layers=1, chat=8, code=8, heldout_chat=2, heldout_code=2, max_new_tokens=8, gen_batch=8, steps=4,
             batch_seqs=2, anchors=4, warmup=1, checkpoint_every=2, eval_every=0, quiet=True)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "p.jsonl"
    lines = [{"prompt": f"Question number {i} about item {i * 7}?", "category": "chat"} for i in range(40)]
    lines += [{"prompt": f"def f{i}(x):\n    return x + {i}", "category": "code"} for i in range(40)]
    path.write_text("".join(json.dumps(p) + "\n" for p in lines))
    return str(path)


def train(out: Path, prompts: str, **kw) -> dict:
    return td.train_drafter(str(PAIR / "target"), str(out), prompts=prompts, **{**SMALL, **kw})


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


# --- training outputs ---------------------------------------------------------------------------------------------

def test_training_never_deletes_a_folder_it_does_not_own(tmp_path, prompts):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(OptionError, match="checkpoint_dir: .*mine exists and is not empty, and is not an earlier output"):
        train(tmp_path / "d", prompts, checkpoint_dir=str(user))
    with pytest.raises(OptionError, match="checkpoint_dir"):              # --force never applies to it
        train(tmp_path / "d", prompts, checkpoint_dir=str(user), force=True)
    shutil.copytree(user, tmp_path / "d2.ckpt")                           # a user's folder where OUT.ckpt goes
    with pytest.raises(OptionError, match="d2.ckpt exists and is not empty"):
        train(tmp_path / "d2", prompts)
    old = tmp_path / "old"                                                # a drafter folder without the marker
    old.mkdir()
    (old / "training.json").write_text("{}")
    with pytest.raises(OptionError, match="old exists and is not empty, and is not an earlier output of train_drafter"):
        train(old, prompts)
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith(("d2.ckpt", "old"))} == before


def test_a_rerun_replaces_its_own_drafter_and_removes_only_its_checkpoints(tmp_path, prompts):
    train(tmp_path / "d", prompts)
    assert owner(tmp_path / "d") == "train_drafter" and not (tmp_path / "d.ckpt").exists()
    train(tmp_path / "d", prompts, steps=2, checkpoint_dir=str(tmp_path / "ck"), curve=str(tmp_path / "c.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "d"]
    train(tmp_path / "d", prompts, steps=2, curve=str(tmp_path / "c.png"))      # its own curve: replaced
    (tmp_path / "user.png").write_bytes((tmp_path / "c.png").read_bytes()[:8] + b"not ours")
    with pytest.raises(OptionError, match="user.png exists and is not an earlier output of train_drafter"):
        train(tmp_path / "d", prompts, curve=str(tmp_path / "user.png"))
    for bad, msg in ((tmp_path, "is a folder"), (tmp_path / "d" / "config.json" / "c.png", "which is a file"),
                     (tmp_path / "c.txt", "must name a .png file")):
        with pytest.raises(OptionError, match=msg):
            train(tmp_path / "e", prompts, curve=str(bad))


def test_non_finite_weights_are_never_loaded_or_written(tmp_path, prompts):
    train(tmp_path / "a", prompts)
    bad = tmp_path / "nan"
    shutil.copytree(tmp_path / "a", bad)
    tensors = load_file(bad / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ToolkitError, match=f"init: .*nan: tensor '{name}' has non-finite weights"):
        train(tmp_path / "b", prompts, init=str(bad))
    assert not (tmp_path / "b").exists()
    from toolkit.dflash import load_drafter, save_drafter

    model = load_drafter(tmp_path / "a")
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    with pytest.raises(ToolkitError, match="has non-finite weights"):
        save_drafter(model, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_quantize_never_converts_a_drafter_with_non_finite_weights(tmp_path, monkeypatch):
    from toolkit.quant import QuantizeOptions, quantize

    quantize_fakes.install(monkeypatch)
    bad = tmp_path / "nan"
    shutil.copytree(PAIR / "draft", bad)
    tensors = load_file(bad / "model.safetensors")
    name = sorted(tensors)[-1]
    tensors[name][0] = float("inf")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ToolkitError, match=f"tensor '{name}' has non-finite weights"):
        quantize(QuantizeOptions(model=str(bad), out=str(tmp_path / "q"), bits="4", device="cpu", check=False,
                                 calibrate=False), progress=False)
    assert not (tmp_path / "q").exists()


def test_a_diverging_run_stops_with_one_line():
    guard = Divergence()
    with pytest.raises(ToolkitError, match="training diverged: the loss is nan at step 3"):
        for step, loss in enumerate([7.0, 6.0, 5.0, float("nan")]):
            guard.check(loss, step)
    model = torch.nn.Linear(2, 1)
    losses = iter(7.16 * 1.2 ** k for k in range(100))             # gradient ascent: the loss climbs
    with pytest.raises(ToolkitError, match=r"training diverged: the loss rose from 7.160 to .* by step \d+ \(lower --lr\)"):
        optimize(model, lambda: model.weight.sum() * 0 + next(losses), 50, 1e-3, "t", warmup=1, quiet=True)


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB filesystem (root can mount one); skipped where it cannot be mounted."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_in_training_is_one_line_and_leaves_no_partial_file(tmpfs, prompts):
    r = subprocess.run([sys.executable, "-m", "toolkit.train_drafter", "--target", str(PAIR / "target"), "--out",
                        str(tmpfs / "d"), "--prompts", prompts, *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()
                                                                   if k != "quiet"], "--quiet"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert last.startswith("error: no space left on the device writing ") and "d.ckpt" in last
    left = [p.name for p in tmpfs.rglob("*")]
    assert not (tmpfs / "d").exists() and not any(".tmp-" in n or n.endswith(".tmp") for n in left), left


def test_a_full_disk_in_quantize_is_one_line_and_leaves_no_partial_file(tmpfs, tmp_path, monkeypatch, capsys):
    from test_quantize_pipeline import write_recipe
    from toolkit.core.errors import run_cli
    from toolkit.quantize import main

    quantize_fakes.install(monkeypatch)                  # the converter in-process: its writes fill the disk
    recipe = write_recipe(tmp_path / "r.toml", str(PAIR / "target"))
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(["--recipe", str(recipe), "--model", str(PAIR / "draft"), "--out", str(tmpfs / "q"),
                              "--bits", "2,3,4,5,6,8", "--device", "cpu", "--no-check", "--no-calibrate"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: no space left on the device"), err[-3:]
    left = [str(p.relative_to(tmpfs)) for p in tmpfs.rglob("*")]
    assert not any(".tmp-" in n or ".partial" in n for n in left), left
