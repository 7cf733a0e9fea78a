"""The mechanisms behind bad input, round two: option domains, the one file reader, own-output markers, the
training outputs (checkpoint folder, curve, lock, non-finite weights, divergence), confinement of a run folder,
SIGTERM and leftovers of killed runs, a full disk (a small tmpfs), devices and the app's port."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_quantize_fakes as quantize_fakes
import toolkit.train.trainer as td
from fuzz_options import COMMANDS, element_type, load
from toolkit.core import files
from toolkit.core.cli import check_options
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.core.folders import MARKER, claim, claim_file, mark, marker, owner, sweep, temp_prefix
from toolkit.train.optim import Divergence, lr_factor, optimize

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


# --- domains ------------------------------------------------------------------------------------------------------

def test_every_number_of_every_command_declares_its_domain():
    """A number with no lower bound would take -1; each option declares lo, above or a kind next to its default."""
    for cmd in COMMANDS:
        cls = load(COMMANDS[cmd].options)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if element_type(hints[f.name]) in (int, float):
                d = f.metadata.get("domain")
                assert d and (d.lo is not None or d.above is not None or d.kind), f"{cmd}.{f.name} declares no domain"


@pytest.mark.parametrize("field,value,msg", [
    ("lr", float("inf"), "lr must be a finite number, got inf"),
    ("lr", float("nan"), "lr must be a finite number"),
    ("lr", 0.0, "lr must be > 0, got 0.0"),
    ("warmup", -5, "warmup must be from 0 to 1000000000, got -5"),
    ("seed", 10**30, "seed must be from 0 to 9223372036854775807"),
    ("intermediate", -1, "intermediate must be from 1"),
    ("heldout_chat", -1, "heldout_chat must be from 0"),
    ("minutes", float("nan"), "minutes must be a finite number"),
    ("taps", [0, -1], "taps must be integers from 0 to 1023, got [0, -1]"),
    ("device", "banana", "device: 'banana' is not a device"),
    ("device", "cpu\n", "device: 'cpu\\n' is not a device"),
    ("mask_token", "", "mask_token is empty"),
])
def test_train_options_are_checked_against_their_domains(field, value, msg):
    with pytest.raises(OptionError) as e:
        check_options(td.TrainConfig, {field: value})
    assert str(e.value).startswith(msg)


def test_zero_warmup_means_no_warmup():
    assert lr_factor(0, 10, 0) == 1.0 and lr_factor(0, 10, 5) == 0.0


# --- the one reader -----------------------------------------------------------------------------------------------

def test_reader_names_the_file_and_the_byte(tmp_path):
    bad = tmp_path / "h.json"
    bad.write_bytes(b'{"chat": ["caf\xe9"]}')
    with pytest.raises(ToolkitError, match=r"^--heldout: .*h.json is not UTF-8 text \(byte 14: b'\\xe9'\)$"):
        files.read_json(bad, "--heldout")
    deep = tmp_path / "d.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ToolkitError, match="nested deeper than 64 levels"):
        files.read_json(deep)
    deep.write_text("[" * 100 + "]" * 100)                     # parses, and is still refused
    with pytest.raises(ToolkitError, match="nested deeper than 64 levels"):
        files.read_json(deep)
    nan = tmp_path / "n.json"
    nan.write_text('{"ms": NaN}')
    with pytest.raises(ToolkitError, match="NaN is not a JSON number"):
        files.read_json(nan)
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ToolkitError, match="is not a readable gzip file"):
        files.read_text(gz)
    gz.write_bytes(gzip.compress(b'{"a": 1}\n\n[2]\n'))
    assert files.read_jsonl(gz) == [(1, {"a": 1}), (3, [2])]
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(65 * 2**20)
    with pytest.raises(ToolkitError, match="larger than the 64 MiB"):
        files.read_text(big)
    with pytest.raises(ToolkitError, match=r"a NUL byte at byte 0"):
        files.read_text(big, limit=2**27)
    with pytest.raises(ToolkitError, match=r"holds the number 1e\+300"):
        files.finite_numbers({"ms": [1.0, 1e300]}, "costs.json")


# --- own-output markers -------------------------------------------------------------------------------------------

def test_a_marker_is_checked_field_by_field(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for text in (b'{"command": "pad"}', json.dumps({**marker("pad"), "extra": 1}).encode(), b"[1]", b"\xff",
                 json.dumps({**marker("pad"), "toolkit": "x"}).encode(), json.dumps({**marker("pad"), "marker": 2}).encode()):
        (d / MARKER).write_bytes(text)
        assert owner(d) is None, text
    mark(d, "pad")
    assert owner(d) == "pad"
    (d / MARKER).unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(marker("pad")))
    (d / MARKER).symlink_to(tmp_path / "elsewhere.json")       # a link is not a marker the command wrote
    assert owner(d) is None


def test_claim_refuses_links_and_files_it_did_not_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(OptionError, match="is a symbolic link"):
        claim(tmp_path / "link", "pad", True)
    (tmp_path / "r.json").write_text('{"tau": 1}')
    with pytest.raises(OptionError, match="is not an earlier output of eval_tau"):
        claim_file(tmp_path / "r.json", command="eval_tau")
    (tmp_path / "r.json").write_text(json.dumps({"tau": 1, "written_by": marker("eval_tau")}))
    assert claim_file(tmp_path / "r.json", command="eval_tau") == tmp_path / "r.json"


def test_sweep_removes_what_killed_runs_left_and_keeps_live_ones(tmp_path):
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_prefix = temp_prefix(out).replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
    (tmp_path / f"{dead_prefix}abc").mkdir()
    (tmp_path / f"{dead_prefix}abc" / "half.bin").write_bytes(b"x")
    (tmp_path / f"{temp_prefix(out)}live").mkdir()                 # this process: alive
    (tmp_path / ".out.abcdef").mkdir()                              # not ours to judge
    (tmp_path / f"{dead_prefix.replace('.out.', '.other.')}x").mkdir()
    removed = sweep(out)
    assert [p.name for p in removed] == [f"{dead_prefix}abc"]
    assert len(list(tmp_path.iterdir())) == 3


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
    from toolkit.quant import quantize

    quantize_fakes.install(monkeypatch)
    bad = tmp_path / "nan"
    shutil.copytree(PAIR / "draft", bad)
    tensors = load_file(bad / "model.safetensors")
    name = sorted(tensors)[-1]
    tensors[name][0] = float("inf")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ToolkitError, match=f"tensor '{name}' has non-finite weights"):
        quantize(model=str(bad), out=str(tmp_path / "q"), bits="4", device="cpu", progress=False, check=False,
                 calibrate=False)
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
    assert last.startswith("error: no space left on the device writing ") and "ckpt.pt" in last
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


# --- demo, confinement, links ---------------------------------------------------------------------------------------

def test_demo_never_takes_a_forged_record_for_a_conversion(tmp_path, monkeypatch):
    from toolkit.assets import smollm2

    out = tmp_path / "demo"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / ".complete.json").write_text(json.dumps({"source": "x", "source_sha256": "x", "files": {}}))
    (out / MARKER).write_text('{"command": "demo"}')
    monkeypatch.setattr(smollm2, "convert", lambda *a: pytest.fail("converted over a user's folder"))
    with pytest.raises(OptionError, match="is not an earlier output of demo"):
        smollm2.prepare(out=str(out))
    assert (out / "notes.txt").read_text() == "mine"


def test_write_card_never_writes_through_a_link(tmp_path):
    """A README.md that is a link is refused wherever it points: out of the drafter, or to its own config.json."""
    from toolkit.eval_tau import put_card

    draft = tmp_path / "draft"
    draft.mkdir()
    (tmp_path / "other.md").write_text("someone else's file\n")
    (draft / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}\n')
    result = {"device": "cpu", "dtype": "float32", "max_new_tokens": 4, "block_sizes": [8], "tau": {"chat": {"8": 2.0}},
              "prompts": {"chat": 1}}
    for target in (tmp_path / "other.md", draft / "config.json", Path("config.json")):
        (draft / "README.md").unlink(missing_ok=True)
        (draft / "README.md").symlink_to(target)
        before = tree(tmp_path)
        with pytest.raises(ToolkitError, match="README.md is a symbolic link .*never written through a link"):
            put_card(draft, result)
        assert tree(tmp_path) == before and (draft / "README.md").is_symlink()


def test_quantize_dry_run_refuses_a_split_its_bf16_target_ignores(tmp_path):
    r = subprocess.run([sys.executable, "-m", "toolkit.quantize", "--model", str(PAIR / "draft"), "--target",
                        str(PAIR / "target"), "--bits", "4", "--out", str(tmp_path / "q"), "--dry-run", "--gpu-split", "8,8"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --gpu-split places an EXL3 target")
    assert "placement" not in r.stdout


# --- signals ------------------------------------------------------------------------------------------------------

CHILD = """
import sys, time
from toolkit.core.errors import run_cli
from toolkit.core.folders import atomic_dir
def main():
    with atomic_dir(sys.argv[1], command="pad") as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 1000)
        print("writing", flush=True)
        time.sleep(60)
run_cli(main)
"""


def start_child(out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "writing"
    return p


def test_sigterm_is_handled_as_ctrl_c_and_a_rerun_cleans_a_killed_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("the earlier output")
    p = start_child(out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err.strip().splitlines()[-1] == "error: interrupted (SIGTERM)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "old.txt").read_text() == "the earlier output"
    p = start_child(out)
    p.kill()                                               # SIGKILL: no clean-up can run
    p.wait(timeout=60)
    assert len(list(tmp_path.iterdir())) == 2              # its temp folder is left beside OUT
    claim(out, "pad", True)                                # a rerun: its claim removes what the killed run left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- the app's port and device ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,msg", [(["--port", "99999"], "error: --port must be from 1 to 65535, got 99999"),
                                      (["--device", "banana"], "error: --device: 'banana' is not a device"),
                                      (["--port", "x"], "error: argument --port: invalid int value: 'x'")])
def test_the_app_refuses_a_bad_port_or_device_before_loading(argv, msg):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "app.py", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(msg), r.stderr[-500:]
    assert time.monotonic() - t0 < 30
