"""The mechanisms behind bad input: option domains, the one file reader, own-output markers, confinement of a run
folder, SIGTERM and leftovers of killed runs, devices and the app's port (the training outputs under hostile
conditions: test_hostile_training.py)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

import toolkit.train.trainer as td
from fuzz_options import COMMANDS, element_type, load
from toolkit.core import files
from toolkit.core.cli import check_options
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.core.folders import MARKER, claim, claim_file, mark, marker, owner, sweep, temp_prefix
from toolkit.train.optim import lr_factor

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
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
