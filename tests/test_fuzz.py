"""Hostile values for every option of every command: a clean refusal or a clean run, never a traceback or data loss.

For each command `python -m toolkit` lists (and app.py), every option of its options dataclass gets a set of
hostile values chosen by the option's role: numbers get nan, inf, negative, zero and huge values; input files get
binary, non-UTF-8, empty, deeply nested JSON, corrupt gzip and oversized files, paths under a file and folders;
input folders get broken model and run folders (report.json or upstream/ linked out of the run); outputs get
files, paths under files, a user's folder, a forged own-output marker and symlinks; devices get names this machine
does not have; free text gets empty, unicode and control characters. Each command line runs in-process
(`main(argv)` under core.errors.run_cli), in a fresh folder holding the user's files, with the model loading and
other heavy work replaced by a stub that records that the checks were passed (REACHED).

Every case must end in exit 0 or REACHED (a value the command may accept) or exit 2 with `error: ...` as the last
line of stderr, and never in an exception. A value that must be refused (a number out of every sensible domain, a
file that is not text, an output that is not the command's own) must end with exit 2 before any work, naming the
flag (numbers) or the file (files). Nothing of the user's changes in any case; a refused case leaves no new file.
The values are fixed, or drawn from a generator seeded with SEED, so a failure reproduces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import io
import json
import os
import random
import shutil
import types
import typing
from pathlib import Path

import pytest
import torch

from test_card import sample_report
from toolkit.__main__ import commands
from toolkit.core.cli import flag_of
from toolkit.core.errors import run_cli

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
SEED = 20261206
HAS_CUDA = torch.cuda.is_available()


class Reached(BaseException):
    """Raised by the stubs: the command passed every check and started its work."""


# The work each command starts once its checks pass (loading weights, training, converting); a stub stands in.
STUBS = ["toolkit.runtime.torch_backend.load_drafter", "toolkit.runtime.torch_backend.load_hf_model",
         "toolkit.train.trainer.load_target", "toolkit.train.tiny.build_pair", "toolkit.assets.fixtures.build",
         "toolkit.synthetic.build.build_plan", "toolkit.quant.pipeline.prepare", "toolkit.assets.smollm2.convert",
         "toolkit.hub.push._upload_all", "toolkit.hub.space.copy_package", "toolkit.app.launch_app"]


@dataclasses.dataclass
class Command:
    module: str
    options: str                      # the options dataclass, "module:Class"
    base: list[str]                   # a command line that passes every check (placeholders filled per case)
    sub: list[str] = dataclasses.field(default_factory=list)


COMMANDS = {
    "bench": Command("toolkit.bench", "toolkit.bench:BenchOptions",
                     ["--out", "{case}/new", "--concurrency", "1", "--max-new-tokens", "4", "--block-sizes", "8",
                      "--quiet"]),
    "card": Command("toolkit.card", "toolkit.card:CardOptions", ["--from", "{run}"]),
    "demo": Command("toolkit.demo", "toolkit.demo:PrepareOptions",
                    ["--out", "{case}/new", "--gguf", "{gguf}"], sub=["prepare"]),
    "eval_tau": Command("toolkit.eval_tau", "toolkit.eval_tau:EvalTauOptions",
                        ["--target", "{target}", "--draft", "{draft}", "--heldout", "{heldout}",
                         "--max-new-tokens", "4", "--quiet"]),
    "fixtures": Command("toolkit.fixtures", "toolkit.fixtures:FixturesOptions", ["--out", "{case}/new"]),
    "generate": Command("toolkit.generate", "toolkit.generate:GenerateOptions",
                        ["--prompt", "hi", "--max-new-tokens", "4"]),
    "pad": Command("toolkit.pad", "toolkit.pad:PadOptions", ["{target}", "{case}/new"]),
    "preview_run": Command("toolkit.preview_run", "toolkit.preview_run:PreviewOptions", ["--out", "{case}/new"]),
    "push": Command("toolkit.push", "toolkit.push:PushOptions", ["--repo", "alice/x", "--from", "{run}", "--retries", "0"]),
    "quantize": Command("toolkit.quantize", "toolkit.quantize:QuantizeOptions",
                        ["--model", "{draft}", "--bits", "4", "--out", "{case}/new", "--no-calibrate", "--no-check",
                         "--device", "cpu"]),
    "space": Command("toolkit.space", "toolkit.space:ExportOptions", ["{case}/new"], sub=["export"]),
    "synth": Command("toolkit.synth", "toolkit.synth:SynthOptions",
                     ["--config", "{synth_config}", "--bits", "4", "--out", "{case}/new", "--device", "cpu", "--quiet"]),
    "tiny_pair": Command("toolkit.tiny_pair", "toolkit.tiny_pair:TinyPairOptions", ["--out", "{case}/new"]),
    "train_drafter": Command("toolkit.train_drafter", "toolkit.train.config:TrainConfig",
                             ["--target", "{target}", "--out", "{case}/new", "--prompts", "{prompts}", "--chat", "8",
                              "--code", "8", "--heldout-chat", "2", "--heldout-code", "2", "--steps", "2", "--quiet"]),
}

# Options read only beside another one: their cases run on this base line instead.
BASE_FOR = {
    ("train_drafter", "heldout"): ["--target", "{target}", "--out", "{case}/new", "--data", "{store}", "--steps", "2",
                                   "--quiet"],
    ("train_drafter", "sharegpt"): ["--target", "{target}", "--out", "{case}/new", "--chat", "8", "--code", "8",
                                    "--steps", "2", "--quiet"],
}
BASE_FOR[("train_drafter", "data")] = BASE_FOR[("train_drafter", "heldout")]

# What each text option names; any other is free text. in_file / in_dir: read; out_dir / out_file: written.
ROLES = {
    "bench": {"target": "in_dir", "draft": "in_dir", "prompts": "prompts", "out": "out_dir", "device": "device"},
    "card": {"out_dir": "run"},
    "demo": {"out": "out_dir", "gguf": "in_file", "license": "text"},
    "eval_tau": {"target": "in_dir", "draft": "in_dir", "heldout": "json", "out": "out_file", "device": "device_auto"},
    "fixtures": {"out": "out_dir"},
    "generate": {"target": "in_dir", "draft": "in_dir", "device": "device"},
    "pad": {"src": "in_dir", "dst": "out_dir"},
    "preview_run": {"out": "out_dir"},
    "push": {"out_dir": "run"},
    "quantize": {"recipe": "toml", "model": "in_dir", "target": "in_dir", "out": "out_dir", "work_dir": "out_dir",
                 "device": "device"},
    "space": {"dir": "out_dir"},
    "synth": {"config": "json", "out": "out_dir", "device": "device_auto"},
    "tiny_pair": {"out": "out_dir"},
    "train_drafter": {"target": "in_dir", "out": "out_dir", "data": "in_dir", "heldout": "json", "prompts": "prompts",
                      "sharegpt": "json", "init": "in_dir", "device": "device_auto", "curve": "out_file",
                      "checkpoint_dir": "out_dir"},
}

# Numeric options for which zero is a meaningful value (every other number must be >= 1 or > 0).
ZERO_OK = {"bench.temperature", "bench.seed", "bench.draft_device", "demo.check_prompts", "eval_tau.draft_device",
           "fixtures.seed", "generate.temperature", "generate.seed", "generate.draft_device", "push.retries",
           "push.retry_delay", "quantize.draft_device", "space.draft_device", "synth.seed", "tiny_pair.seed",
           "train_drafter.taps", "train_drafter.chat", "train_drafter.code", "train_drafter.heldout_chat",
           "train_drafter.heldout_code", "train_drafter.warmup", "train_drafter.seed", "train_drafter.eval_every",
           "app.draft_device"}

# app.py has its own argparse parser: its options, by role.
APP = {"port": ("--port", "number"), "draft_device": ("--draft-device", "number"), "device": ("--device", "device"),
       "gpu_split": ("--gpu-split", "text"), "target": ("--target", "text"), "host": ("--host", "text")}


# --- values -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Value:
    name: str
    text: str
    refuse: bool            # must end in exit 2 before any work
    names: str = ""         # what the error line must contain (a flag, a file name)


def number_values(key: str, flag: str, integer: bool) -> list[Value]:
    huge = "9" * 30 if integer else "1e308"
    zero_ok = key in ZERO_OK
    out = [Value("nan", "nan", True, flag), Value("inf", "inf", True, flag), Value("-inf", "-inf", True, flag),
           Value("negative", "-1", True, flag), Value("huge", huge, True, flag), Value("zero", "0", not zero_ok, flag),
           Value("empty", "", True, flag), Value("unicode-digits", "١٢", False), Value("hex", "0x10", True, flag)]
    if key == "app.port":
        out.append(Value("port-too-big", "99999", True, flag))
    return out


def text_values(rng: random.Random, checked: bool = True) -> list[Value]:
    """Free text; bytes that are not UTF-8 (lone surrogates in argv) must be refused where options are checked."""
    noise = "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0xa0, 0x2fff), 0x202e, 0x200b, 0x1f600]))
                    for _ in range(24))
    binary = (b"\xff" + bytes(rng.randrange(0x80, 0x100) for _ in range(8))).decode("utf-8", "surrogateescape")
    return [Value("empty", "", False), Value("newline", "a\nb: c", False), Value("unicode", noise, False),
            Value("long", "x" * 5000, False), Value("braces", "{bits}{0}%s", False),
            Value("not-utf8", f"hi {binary} there", checked)]


def device_values(auto: bool) -> list[Value]:
    out = [Value("banana", "banana", True, "banana"), Value("cuda-99", "cuda:99", True, "cuda:99"),
           Value("empty", "", True), Value("newline", "cpu\n", True)]
    if not HAS_CUDA:
        out.append(Value("cuda-without-gpu", "cuda", True, "cuda"))
    return out


def file_values(kind: str) -> list[Value]:
    """Hostile input files ({inputs}/NAME); `kind` says which of them the option must refuse."""
    json_like = kind in ("json", "toml")
    return [Value("missing", "{case}/nothing.json", True), Value("folder", "{inputs}/afolder", True),
            Value("under-file", "{inputs}/empty.txt/x", True), Value("empty-string", "", True),
            Value("empty", "{inputs}/empty.txt", kind != "in_file"),
            Value("binary", "{inputs}/binary.bin", kind != "in_file", "binary.bin" if kind != "in_file" else ""),
            Value("latin1", "{inputs}/latin1.txt", kind != "in_file", "latin1.txt" if kind != "in_file" else ""),
            Value("deep-json", "{inputs}/deep.json", json_like or kind == "prompts"),
            Value("corrupt-gz", "{inputs}/corrupt.jsonl.gz", kind == "prompts"),
            Value("huge", "{inputs}/huge.txt", kind != "in_file", "huge.txt" if kind != "in_file" else ""),
            Value("symlink-out", "{inputs}/link-to-secret.txt", json_like),
            Value("unicode-missing", "{case}/ünï\u202e.json", True)]


def folder_values(role: str) -> list[Value]:
    out = [Value("missing", "{case}/nothing", True), Value("a-file", "{inputs}/empty.txt", True),
           Value("under-file", "{inputs}/empty.txt/x", True), Value("empty-string", "", True),
           Value("binary-config", "{bad_binary_config}", True), Value("deep-config", "{bad_deep_config}", True),
           Value("list-config", "{bad_list_config}", True)]
    if role == "run":
        out += [Value(n, "{" + n + "}", True) for n in ("run_upstream_link", "run_readme_link", "run_report_link",
                                                         "run_binary_report", "run_deep_report", "run_model_newline")]
    return out


def output_values(role: str) -> list[Value]:
    out = [Value("under-file", "{case}/f.txt/x", True), Value("empty-string", "", True),
           Value("unicode-new", "{case}/ünï-ʘ\u202e", False), Value("cwd", ".", True)]
    if role == "out_dir":
        out += [Value("a-file", "{case}/f.txt", True), Value("user-folder", "{case}/user", True),
                Value("forged-marker", "{case}/forged", True), Value("symlink", "{case}/link", True),
                Value("home", "~", True)]
    else:
        out += [Value("a-folder", "{case}/user", True), Value("user-file", "{case}/f.txt", True),
                Value("symlink-out", "{case}/link-file", True)]
    return out


def values_for(cmd: str, name: str, tp, rng: random.Random) -> list[Value]:
    key, flag = f"{cmd}.{name}", flag_for(cmd, name)
    if tp in (int, float):
        return number_values(key, flag, tp is int)
    role = APP[name][1] if cmd == "app" else ROLES.get(cmd, {}).get(name, "text")
    if role in ("device", "device_auto"):
        return device_values(role == "device_auto")
    if role in ("in_file", "json", "toml", "prompts"):
        return file_values(role)
    if role == "text" and cmd == "demo":
        return file_values("text")
    if role in ("in_dir", "run"):
        return folder_values(role)
    if role in ("out_dir", "out_file"):
        return output_values(role)
    return text_values(rng, checked=cmd != "app")


# --- options of every command -------------------------------------------------------------------------------------

def load(spec: str):
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


def element_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if origin in (list, tuple):
        tp = typing.get_args(tp)[0]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = str
    return tp


def options_of(cmd: str) -> list[tuple[str, type]]:
    if cmd == "app":
        return [(n, int if role == "number" else str) for n, (_, role) in APP.items()]
    cls = load(COMMANDS[cmd].options)
    hints = typing.get_type_hints(cls)
    return [(f.name, element_type(hints[f.name])) for f in dataclasses.fields(cls) if element_type(hints[f.name]) is not bool]


def flag_for(cmd: str, name: str) -> str:
    return APP[name][0] if cmd == "app" else flag_of(load(COMMANDS[cmd].options), name)


def with_value(cmd: str, name: str, text: str) -> list[str]:
    """The base command line with option `name` set to `text` (a positional replaced in place)."""
    if cmd == "app":
        return [f"{APP[name][0]}={text}"]
    c, cls = COMMANDS[cmd], load(COMMANDS[cmd].options)
    c = dataclasses.replace(c, base=BASE_FOR.get((cmd, name), c.base))
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.metadata.get("positional"):
        pos = [f.name for f in dataclasses.fields(cls) if f.metadata.get("positional")]
        argv, k = list(c.base), 0
        for i, tok in enumerate(argv):
            if not tok.startswith("--") and (i == 0 or not argv[i - 1].startswith("--")):
                if pos[k] == name:
                    argv[i] = text
                    break
                k += 1
        return c.sub + argv
    flag, argv, skip = flag_of(cls, name), [], False
    for tok in c.base:
        if tok == flag:
            skip = True
            continue
        if skip and not tok.startswith("--"):
            continue
        skip = False
        argv.append(tok)
    return c.sub + argv + [f"{flag}={text}"]


CASES = [(cmd, name, tp) for cmd in [*COMMANDS, "app"] for name, tp in options_of(cmd)]


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


def check_option(cmd: str, name: str, tp, main, inputs, tmp_path, monkeypatch) -> list[str]:
    names, _ = inputs
    rng = random.Random(f"{SEED}-{cmd}-{name}")
    problems = []
    for k, v in enumerate(values_for(cmd, name, tp, rng)):
        folder = tmp_path / f"c{k}"
        make_case(folder)
        argv = [fill(a, {**names, "case": str(folder)}) for a in with_value(cmd, name, v.text)]
        before = signature(folder)
        r = run_case(main, argv, folder, monkeypatch)
        why = judge(v, flag_for(cmd, name), r, before, signature(folder))
        if why:
            problems.append(f"FUZZFAIL {cmd} {flag_for(cmd, name)}={v.name}: {why}")
    return problems


def fill(text: str, names: dict) -> str:
    """`text` with {name} placeholders filled in (free text such as '{bits}' stays as it is)."""
    for k, v in names.items():
        text = text.replace("{" + k + "}", v)
    return text


def main_of(cmd: str, app_main):
    return app_main if cmd == "app" else importlib.import_module(COMMANDS[cmd].module).main


# --- the tests ----------------------------------------------------------------------------------------------------

def test_every_command_is_fuzzed():
    assert set(commands()) == set(COMMANDS), "a new command needs its base command line and roles here"
    for cmd, roles in ROLES.items():
        have = {n for n, _ in options_of(cmd)}
        assert set(roles) <= have, (cmd, set(roles) - have)
    assert len(CASES) >= 100


BASES = [(cmd, None) for cmd in [*COMMANDS, "app"]] + list(BASE_FOR)


@pytest.mark.parametrize("cmd,name", BASES, ids=[f"{c}-{n or 'base'}" for c, n in BASES])
def test_base_command_line_passes_the_checks(cmd, name, inputs, stubs, app_main, tmp_path, monkeypatch):
    """The base lines are accepted, so a refusal in the cases is the hostile value's doing."""
    names, _ = inputs
    make_case(tmp_path / "c")
    c = COMMANDS.get(cmd)
    base = BASE_FOR.get((cmd, name), c.base) if c else []
    argv = [fill(a, {**names, "case": str(tmp_path / "c")}) for a in (c.sub if c else []) + base]
    r = run_case(main_of(cmd, app_main), argv, tmp_path / "c", monkeypatch)
    assert r["exc"] is None and r["code"] in (0, "reached"), (argv, r)


@pytest.mark.parametrize("cmd,name,tp", CASES, ids=[f"{c}-{n}" for c, n, _ in CASES])
def test_hostile_values(cmd, name, tp, inputs, stubs, app_main, tmp_path, monkeypatch):
    problems = check_option(cmd, name, tp, main_of(cmd, app_main), inputs, tmp_path, monkeypatch)
    names, sig = inputs
    changed = sorted(k for k, s in sig.items() if signature(Path(names["inputs"])).get(k) != s)
    assert not changed, f"inputs changed: {changed[:5]}"
    assert not problems, "\n".join(problems)
