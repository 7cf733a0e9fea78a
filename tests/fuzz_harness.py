"""How tests/slow/test_fuzz.py runs a case: the user's inputs built once (broken files, folders and runs), the stubs that
stand in for the heavy work once the checks pass (Reached), a command line run in-process under run_cli in a fresh
folder, and the verdict on what it did; `cli` and `refused` for a single case. tests/slow/test_bad_numbers.py,
test_bad_places.py and tests/test_bad_input_files.py use them too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from fuzz_options import COMMANDS, SEED, Value
from test_card import sample_report
from toolkit.core.errors import run_cli

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"


class Reached(BaseException):
    """Raised by the stubs: the command passed every check and started its work."""


# The work each command starts once its checks pass (loading weights, training, converting); a stub stands in.
STUBS = ["toolkit.runtime.torch_backend.load_drafter", "toolkit.runtime.torch_backend.load_hf_model",
         "toolkit.train.trainer.load_target", "toolkit.train.tiny.build_pair", "toolkit.assets.fixtures.build",
         "toolkit.synthetic.build.build_plan", "toolkit.quant.pipeline.prepare", "toolkit.assets.smollm2.convert",
         "toolkit.hub.push._upload_all", "toolkit.hub.space.copy_package", "toolkit.app.launch_app"]


# --- fixtures: the inputs, built once -------------------------------------------------------------------------------

def write_run(run: Path, report: dict) -> None:
    run.mkdir()
    for r in report["results"]:
        (run / r["folder"]).mkdir()
        (run / r["folder"]).joinpath("config.json").write_text("{}")
        (run / r["folder"]).joinpath("README.md").write_text("# card\n")
    (run / "report.json").write_text(json.dumps(report))
    (run / "report.md").write_text("# report\n")
    (run / "tau_top1.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (run / "upstream").mkdir()
    (run / "upstream" / "README.md").write_text("---\nlicense: mit\n---\n# upstream card\n")


def build_store(folder: Path, target: Path) -> None:
    """An answer store made for the tiny target (train_drafter --data), with its heldout.json."""
    from toolkit.train.prepare import store_meta
    from toolkit.train.store import AnswerStore, Row, prompt_key

    store = AnswerStore(folder, store_meta(str(target), 16), 512)
    store.append([Row(prompt_key(f"q{i}"), [1, 2, 3, 4, 5, 6], 2, "chat" if i % 2 else "code") for i in range(8)])
    (folder / "heldout.json").write_text(json.dumps({"chat": ["What is a list?"], "code": ["def f(x):"]}))


def build_inputs(root: Path) -> dict[str, str]:
    rng = random.Random(SEED)
    names = {"inputs": root, "target": root / "pair" / "target", "draft": root / "pair" / "draft"}
    shutil.copytree(PAIR, root / "pair")
    (root / "afolder").mkdir()
    (root / "afolder" / "x.txt").write_text("x")
    (root / "empty.txt").write_text("")
    (root / "binary.bin").write_bytes(b"\xff\xfe\x00\x81" + rng.randbytes(4096))
    (root / "latin1.txt").write_bytes('{"chat": ["caf\xe9"]}\n'.encode("latin-1"))
    depth = 200_000
    (root / "deep.json").write_text('{"a":' * depth + "1" + "}" * depth)
    (root / "corrupt.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + rng.randbytes(512))
    with open(root / "huge.txt", "wb") as f:
        f.truncate(300 * 2**20)                                   # sparse: costs no disk
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for reading or upload\n")
    (root / "link-to-secret.txt").symlink_to(outside / "secret.txt")
    prompts = [{"prompt": f"Question number {i} about item {i * 7}?", "category": "chat"} for i in range(40)]
    prompts += [{"prompt": f"def f{i}(x):\n    return x + {i}", "category": "code"} for i in range(40)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (root / "heldout.json").write_text(json.dumps({"chat": ["What is a list?"], "code": ["def f(x):"]}))
    (root / "synth.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "hidden_size": 128}))
    (root / "gguf").mkdir()
    (root / "gguf" / "model.gguf").write_bytes(b"GGUF stand-in")
    (root / "gguf" / "LICENSE").write_text("Apache License\n")
    for name, text in (("binary_config", b"\xff\xfe\x00config"), ("deep_config", (root / "deep.json").read_bytes()),
                       ("list_config", b"[1, 2]")):
        d = root / f"bad_{name}"
        shutil.copytree(PAIR / "target", d)
        (d / "config.json").write_bytes(text)
        names[f"bad_{name}"] = d
    report = sample_report(0)
    write_run(root / "run", report)
    names["run"] = root / "run"
    variants = {
        "run_upstream_link": lambda d: (shutil.rmtree(d / "upstream"), (d / "upstream").symlink_to(outside)),
        "run_readme_link": lambda d: ((d / "upstream" / "README.md").unlink(),
                                      (d / "upstream" / "README.md").symlink_to(outside / "secret.txt")),
        "run_report_link": lambda d: ((outside / "report.json").write_text(json.dumps(report)),
                                      (d / "report.json").unlink(), (d / "report.json").symlink_to(outside / "report.json")),
        "run_binary_report": lambda d: (d / "report.json").write_bytes(b"\xff\xfe{}"),
        "run_deep_report": lambda d: (d / "report.json").write_bytes((root / "deep.json").read_bytes()),
        "run_model_newline": lambda d: (d / "report.json").write_text(json.dumps({**report, "model": "a/b\n# injected"})),
    }
    for name, edit in variants.items():
        write_run(root / name, report)
        edit(root / name)
        names[name] = root / name
    build_store(root / "store", names["target"])
    names.update(store=root / "store", prompts=root / "prompts.jsonl", heldout=root / "heldout.json", synth_config=root / "synth.json",
                 gguf=root / "gguf" / "model.gguf")
    return {k: str(v) for k, v in names.items()}


def signature(root: Path) -> dict:
    """Every entry under `root` (links not followed) with its kind, size and mtime: what a command might change."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns,
                                             os.readlink(p) if p.is_symlink() else None)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-inputs")
    names = build_inputs(root)
    yield names, signature(root)


@pytest.fixture(scope="module")
def app_main():
    spec = importlib.util.spec_from_file_location("dflash_app_fuzz", ROOT / "app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.fixture
def stubs(monkeypatch, tmp_path):
    def reached(*a, **k):
        raise Reached

    for path in STUBS:
        mod, _, attr = path.rpartition(".")
        monkeypatch.setattr(importlib.import_module(mod), attr, reached)
    import toolkit.assets.smollm2 as smollm2

    gguf_sha = hashlib.sha256(b"GGUF stand-in").hexdigest()
    monkeypatch.setattr(smollm2, "GGUF_SHA256", gguf_sha)           # the stand-in GGUF passes the hash check
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_tests")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# --- running a case -----------------------------------------------------------------------------------------------

def make_case(folder: Path) -> None:
    """The user's files around the case: a file, a folder of theirs, a forged marker, links."""
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's notes")
    (folder / "f.txt").write_text("a user's file")
    (folder / "user").mkdir()
    (folder / "user" / "notes.txt").write_text("mine")
    (folder / "forged").mkdir()
    (folder / "forged" / "notes.txt").write_text("mine")
    (folder / "forged" / ".dflash-toolkit.json").write_text('{"command": "x"}')
    (folder / "forged" / ".complete.json").write_text('{"files": {}, "source": "x", "source_sha256": "x"}')
    (folder / "empty-target").mkdir()
    (folder / "link").symlink_to(folder / "empty-target")
    (folder / "link-file").symlink_to(folder / "keep.txt")


def run_case(main, argv: list[str], folder: Path, monkeypatch) -> dict:
    """main(argv) under run_cli in `folder`: exit code (or "reached"), stderr, and any exception it let out."""
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(folder))
    err, out = io.StringIO(), io.StringIO()
    result = {"code": None, "exc": None}

    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            run_cli(lambda: main(argv))
    except SystemExit as e:
        result["code"] = e.code
    except Reached:
        result["code"] = "reached"
    except BaseException as e:  # noqa: BLE001 - the very thing this test looks for
        result["exc"] = f"{type(e).__name__}: {str(e)[:300]}"
    result["stderr"] = err.getvalue()
    return result


def judge(v: Value, flag: str, r: dict, before: dict, after: dict) -> str | None:
    """What went wrong in one case, or None."""
    lines = r["stderr"].strip().splitlines()
    last = lines[-1] if lines else ""
    if r["exc"]:
        return f"exception {r['exc']}"
    if "Traceback" in r["stderr"]:
        return "a traceback on stderr"
    changed = sorted(k for k, s in before.items() if after.get(k) != s)
    if changed:
        return f"changed the user's {changed[:3]}"
    if r["code"] == 2 and not last.startswith("error: "):
        return f"exit 2 but the last stderr line is {last[:200]!r}"
    if r["code"] not in (0, 2, "reached"):
        return f"exit {r['code']!r}: {last[:200]!r}"
    if v.refuse:
        if r["code"] != 2:
            return f"not refused ({r['code']})"
        if v.names and v.names not in last:
            return f"the error does not name {v.names!r}: {last[:200]!r}"
        new = sorted(set(after) - set(before))
        if new:
            return f"refused but left {new[:3]}"
    return None


def fill(text: str, names: dict) -> str:
    """`text` with {name} placeholders filled in (free text such as '{bits}' stays as it is)."""
    for k, v in names.items():
        text = text.replace("{" + k + "}", v)
    return text


def main_of(cmd: str, app_main):
    return app_main if cmd == "app" else importlib.import_module(COMMANDS[cmd].module).main


def cli(cmd: str, argv: list[str], folder: Path, monkeypatch, app_main=None) -> dict:
    """One command line run in-process in `folder` (run_case), with its last stderr line; never a traceback."""
    folder.mkdir(exist_ok=True)
    r = run_case(main_of(cmd, app_main), argv, folder, monkeypatch)
    lines = r["stderr"].strip().splitlines()
    r["last"] = lines[-1] if lines else ""
    assert r["exc"] is None and "Traceback" not in r["stderr"], r
    return r


def refused(r: dict, *words: str) -> None:
    """Exit 2, one `error:` line as the last line, before any work, naming each of `words`."""
    assert r["code"] == 2 and r["last"].startswith("error: "), r
    assert all(w in r["last"] for w in words), (r["last"], words)
