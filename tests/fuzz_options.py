"""What tests/slow/test_fuzz.py fuzzes: every command's base command line, its options by role, and the hostile values
each role gets (numbers, free text, devices, input files and folders, outputs). The values are fixed, or drawn
from a generator seeded with SEED, so a failure reproduces.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import types
import typing

import torch

from toolkit.core.cli import flag_of

SEED = 20261206
HAS_CUDA = torch.cuda.is_available()


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
    "push": Command("toolkit.push", "toolkit.hub.push:PushOptions", ["--repo", "alice/x", "--from", "{run}", "--retries", "0"]),
    "quantize": Command("toolkit.quantize", "toolkit.quant.options:QuantizeOptions",
                        ["--model", "{draft}", "--bits", "4", "--out", "{case}/new", "--no-calibrate", "--no-check",
                         "--device", "cpu"]),
    "space": Command("toolkit.space", "toolkit.hub.space:ExportOptions", ["{case}/new"], sub=["export"]),
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
