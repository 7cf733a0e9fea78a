"""The cases of tests/slow/test_bad_input.py: per command, a bad command line, the words its error line must hold and
the state of its output location before the run (absent, a user's folder, a file, under a file, unwritable, the
current folder, the home folder, a copy of its source)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

PAIR = Path(__file__).resolve().parents[1] / "toolkit" / "data" / "tiny_pair"
HAS_CUDA = torch.cuda.is_available()


@dataclass
class Case:
    id: str
    cmd: str                     # python -m toolkit.<cmd>
    argv: list[str]              # {out} {case} and the fixture names below are filled in
    msg: str                     # expected in the error line
    out: str = "absent"          # state of {out}: absent unowned file under_file unwritable cwd home src_copy
    env: dict = field(default_factory=dict)
    watch: tuple[str, ...] = ()  # fixture inputs the command reads: they must not change either


def pad_cases() -> list[Case]:
    c = [Case("dst-unowned", "pad", ["{model}", "{out}"], "is not an earlier output of pad", "unowned"),
         Case("dst-file", "pad", ["{model}", "{out}"], "exists and is not a folder", "file"),
         Case("dst-under-file", "pad", ["{model}", "{out}"], "which is a file", "under_file"),
         Case("dst-unwritable", "pad", ["{model}", "{out}"], "cannot write in", "unwritable"),
         Case("dst-cwd", "pad", ["{model}", "{out}"], "is the current folder", "cwd"),
         Case("dst-home", "pad", ["{model}", "{out}"], "home folder", "home"),
         Case("force-dst-is-src", "pad", ["{out}", "{out}", "--force"], "is SRC itself", "src_copy"),
         Case("force-dst-inside-src", "pad", ["{out}", "{out}/sub", "--force"], "SRC itself or inside it", "src_copy"),
         Case("align-zero", "pad", ["{model}", "{out}", "--align", "0"], "--align must be from 1 to 4096, got 0"),
         Case("align-negative", "pad", ["{model}", "{out}", "--align", "-128"], "--align must be"),
         Case("src-missing", "pad", ["{case}/nothing", "{out}"], "SRC: ", "absent"),
         Case("src-exl3", "pad", ["{exl3}", "{out}"], "is an EXL3 checkpoint"),
         Case("src-truncated", "pad", ["{truncated}", "{out}"], "not a readable safetensors file (truncated"),
         Case("src-header-list", "pad", ["{header_list}", "{out}"], "the header is a JSON list"),
         Case("src-no-offsets", "pad", ["{no_offsets}", "{out}"], "data_offsets must be [begin, end]"),
         Case("src-config-list", "pad", ["{config_list}", "{out}"], "is not a JSON object"),
         Case("src-moe", "pad", ["{moe}", "{out}"], "padding supports dense"),
         Case("src-no-config", "pad", ["{no_config}", "{out}"], "has no config.json")]
    return [_watch_inputs(x) for x in c]


def tiny_pair_cases() -> list[Case]:
    return [Case("seed-negative", "tiny_pair", ["--out", "{out}", "--seed", "-1"], "--seed must be from 0"),
            Case("target-steps-zero", "tiny_pair", ["--out", "{out}", "--target-steps", "0"], "--target-steps must be >= 1"),
            Case("draft-steps-negative", "tiny_pair", ["--out", "{out}", "--draft-steps", "-5"], "--draft-steps must be >= 1"),
            Case("sequences-zero", "tiny_pair", ["--out", "{out}", "--sequences", "0"], "--sequences must be >= 1"),
            Case("out-unowned", "tiny_pair", ["--out", "{out}"], "is not an earlier output of tiny_pair", "unowned"),
            Case("out-file", "tiny_pair", ["--out", "{out}"], "exists and is not a folder", "file"),
            Case("out-cwd", "tiny_pair", ["--out", "{out}"], "is the current folder", "cwd")]


def fixtures_cases() -> list[Case]:
    return [Case("block-size-one", "fixtures", ["--out", "{out}", "--block-size", "1"], "--block-size must be from 2"),
            Case("seed-negative", "fixtures", ["--out", "{out}", "--seed", "-3"], "--seed must be from 0"),
            Case("out-unowned", "fixtures", ["--out", "{out}"], "is not an earlier output of fixtures", "unowned"),
            Case("out-file", "fixtures", ["--out", "{out}", "--pair"], "exists and is not a folder", "file"),
            Case("out-under-file", "fixtures", ["--out", "{out}"], "which is a file", "under_file"),
            Case("out-home", "fixtures", ["--out", "{out}"], "home folder", "home")]


def space_cases() -> list[Case]:
    e = ["export", "{out}"]
    return [Case("dir-unowned", "space", e, "dir: ", "unowned"),
            Case("dir-file", "space", e, "exists and is not a folder", "file"),
            Case("dir-cwd", "space", e, "is the current folder", "cwd"),
            Case("dir-unwritable", "space", e, "cannot write in", "unwritable"),
            Case("target-without-draft", "space", [*e, "--target", "me/t"], "give both"),
            Case("exllamav3-on-cpu", "space", [*e, "--hardware", "cpu-basic", "--backend", "exllamav3"], "needs GPU hardware"),
            Case("bad-backend", "space", [*e, "--backend", "tensorrt"], "backend must be auto, torch or exllamav3"),
            Case("title-breaks-yaml", "space", [*e, "--title", "a: b"], "--title: 'a: b' is not a one-line title"),
            Case("target-not-a-repo", "space", [*e, "--target", "a b", "--draft", "me/d"], "nor a Hub repo id"),
            Case("no-wheel-for-t4", "space", [*e, "--hardware", "t4-small"], "sm_75")]


def synth_cases() -> list[Case]:
    a = ["--config", "{synth_config}", "--bits", "4", "--out", "{out}", "--quiet"]
    c = [Case("out-unowned", "synth", a, "is not an earlier output of synth (pass --overwrite", "unowned"),
         Case("out-file", "synth", a, "exists and is not a folder", "file"),
         Case("out-home", "synth", a, "home folder", "home"),
         Case("shard-gb-inf", "synth", [*a, "--shard-gb", "inf"], "--shard-gb must be a finite number"),
         Case("shard-gb-zero", "synth", [*a, "--shard-gb", "0"], "--shard-gb must be > 0, got 0.0"),
         Case("shard-gb-nan", "synth", [*a, "--shard-gb", "nan"], "--shard-gb must be a finite number, got nan"),
         Case("std-negative", "synth", [*a, "--std", "-0.02"], "--std must be > 0"),
         Case("device-unknown", "synth", [*a, "--device", "tpu"], "--device: 'tpu' is not a device"),
         Case("bits-nine", "synth", [*a[:3], "9", *a[4:]], "--bits must be an integer from 1 to 8"),
         Case("bits-half", "synth", [*a[:3], "2.5", *a[4:]], "--bits must be an integer from 1 to 8"),
         Case("head-bits-twelve", "synth", [*a, "--head-bits", "12"], "--head-bits must be an integer"),
         Case("seed-negative", "synth", [*a, "--seed", "-1"], "--seed must be from 0"),
         Case("config-list", "synth", ["--config", "{list_json}", *a[2:]], "expected a JSON object"),
         Case("config-missing", "synth", ["--config", "{case}/nothing.json", *a[2:]], "no such file")]
    if not HAS_CUDA:
        c.append(Case("device-cuda-without-gpu", "synth", [*a, "--device", "cuda"], "no CUDA GPU is available"))
    return [_watch_inputs(x) for x in c]


def demo_cases() -> list[Case]:
    p = ["prepare", "--out", "{out}"]
    return [Case("out-unowned", "demo", p, "is not an earlier output of demo", "unowned"),
            Case("out-file", "demo", p, "exists and is not a folder", "file"),
            Case("check-prompts-too-many", "demo", [*p, "--check-prompts", "9"], "--check-prompts must be from 0 to 3"),
            Case("check-prompts-negative", "demo", [*p, "--check-prompts", "-1"], "--check-prompts must be from 0"),
            Case("gguf-missing", "demo", [*p, "--gguf", "{case}/nothing.gguf"], "--gguf: "),
            Case("license-missing", "demo", [*p, "--gguf", "{fake_gguf}", "--license", "{case}/NOPE"], "--license: "),
            Case("gguf-wrong-file", "demo", [*p, "--gguf", "{fake_gguf}"], "sha256")]


def push_cases() -> list[Case]:
    base = ["--repo", "alice/drafter-exl3", "--from", "{run}"]
    tok = {"HF_TOKEN": "hf_dummy_token_for_tests", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    c = [Case("repo-dotdot", "push", ["--repo", "../..", "--from", "{run}"], "--repo must be USER/NAME, got '../..'"),
         Case("repo-no-slash", "push", ["--repo", "drafter", "--from", "{run}"], "--repo must be USER/NAME"),
         Case("retries-negative", "push", [*base, "--retries", "-1"], "--retries must be from 0 to 100, got -1"),
         Case("retry-delay-negative", "push", [*base, "--retry-delay", "-1"], "--retry-delay must be from 0 to 3600"),
         Case("retry-delay-nan", "push", [*base, "--retry-delay", "nan"], "--retry-delay must be"),
         Case("endpoint-malformed", "push", [*base, "--endpoint", "htp:/nowhere"], "--endpoint: 'htp:/nowhere' is not an http(s) URL"),
         Case("folder-escapes-from", "push", ["--repo", "alice/x", "--from", "{run_escape}", "--dry-run"], "is not a folder inside"),
         Case("report-step-interrupted", "push", ["--repo", "alice/x", "--from", "{run_incomplete}"], "incomplete quantize run"),
         Case("no-report", "push", ["--repo", "alice/x", "--from", "{case}"], "has no report.json"),
         Case("report-is-a-list", "push", ["--repo", "alice/x", "--from", "{run_list}"], "expected a JSON object, got a JSON list"),
         Case("report-bits-text", "push", ["--repo", "alice/x", "--from", "{run_badbits}"], "results[0].bits must be a number from 1 to 8 bits per weight"),
         Case("connection-refused", "push", [*base, "--endpoint", "{refused}", "--retries", "0"], "no connection to", env=tok),
         Case("http-500", "push", [*base, "--endpoint", "{url500}", "--retries", "0"], "a server error at", env=tok),
         Case("offline-mode", "push", [*base, "--endpoint", "{refused}"], "offline mode",
              env={**tok, "HF_HUB_OFFLINE": "1"})]
    return [_watch_inputs(x) for x in c]


def card_cases() -> list[Case]:
    c = [Case("no-report", "card", ["--from", "{case}"], "no report.json"),
         Case("report-is-a-list", "card", ["--from", "{run_list}"], "expected a JSON object"),
         Case("repo-dotdot", "card", ["--from", "{run}", "--repo", "../.."], "--repo must be USER/NAME"),
         Case("bits-not-in-report", "card", ["--from", "{run}", "--bits", "9"], "is not in report results"),
         Case("folder-escapes-from", "card", ["--from", "{run_escape}"], "is not a folder inside"),
         Case("schema-two", "card", ["--from", "{run_schema2}"], "schema must be 1")]
    return [_watch_inputs(x) for x in c]


def others_cases() -> list[Case]:
    """Commands other parts own, where they already behave (strict loading, recipe types, held-out file)."""
    t, d = str(PAIR / "target"), str(PAIR / "draft")
    return [Case("drafter-as-target", "generate", ["--target", d, "--prompt", "hi"], "is a DFlash drafter, not a target model"),
            Case("target-as-draft", "generate", ["--target", t, "--draft", t, "--prompt", "hi"], "not a DFlash drafter"),
            Case("exl3-target-on-torch", "generate", ["--target", "{exl3}", "--prompt", "hi"], "is an EXL3 checkpoint"),
            Case("truncated-target", "generate", ["--target", "{truncated}", "--prompt", "hi"], "truncated"),
            Case("max-new-tokens-zero", "generate", ["--target", t, "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
            Case("target-missing", "generate", ["--target", "{case}/nothing", "--prompt", "hi"], "is not a folder"),
            Case("empty-heldout", "eval_tau", ["--target", t, "--draft", d, "--heldout", "{empty_file}"], "--heldout: "),
            Case("recipe-wrong-type", "quantize", ["--recipe", "{bad_recipe}", "--out", "{out}"], "model.id must be a string"),
            Case("bits-out-of-range", "quantize", ["--model", d, "--bits", "9", "--out", "{out}"], "outside exllamav3's range")]


def before_work_cases() -> list[Case]:
    """Output locations and devices refused before any model is loaded (issue 20, class 3)."""
    t, d = str(PAIR / "target"), str(PAIR / "draft")
    ev = ["--target", t, "--draft", d, "--out", "{out}"]
    tr = ["--target", t, "--out", "{out}", "--steps", "1"]
    q = ["--model", d, "--bits", "4", "--out", "{out}"]
    c = [Case("out-unowned", "bench", ["--out", "{out}"], "is not an earlier output of bench", "unowned"),
         Case("out-file", "bench", ["--out", "{out}"], "exists and is not a folder", "file"),
         Case("out-under-file", "bench", ["--out", "{out}"], "which is a file", "under_file"),
         Case("out-cwd", "bench", ["--out", "{out}"], "is the current folder", "cwd"),
         Case("block-sizes-one", "bench", ["--out", "{out}", "--block-sizes", "auto", "1"], "--block-sizes must be integers >= 2"),
         Case("out-folder", "eval_tau", ev, "is a folder: name a JSON file", "unowned"),
         Case("out-under-file", "eval_tau", ev, "which is a file", "under_file"),
         Case("out-unwritable", "eval_tau", ev, "cannot write in", "unwritable"),
         Case("block-sizes-text", "eval_tau", [*ev, "--block-sizes", "8", "x"], "--block-sizes must be integers >= 2"),
         Case("out-unowned", "train_drafter", tr, "is not an earlier output of train_drafter", "unowned"),
         Case("out-file", "train_drafter", tr, "exists and is not a folder", "file"),
         Case("out-unwritable", "train_drafter", tr, "cannot write in", "unwritable"),
         Case("checkpoint-dir-file", "train_drafter", ["--target", t, "--out", "{case}/new", "--checkpoint-dir", "{out}"],
              "--checkpoint-dir", "file"),
         Case("out-file", "quantize", q, "exists and is not a folder", "file"),
         Case("out-under-file", "quantize", q, "which is a file", "under_file")]
    if not HAS_CUDA:
        c.append(Case("device-cuda-without-gpu", "generate", ["--prompt", "hi", "--device", "cuda"], "no CUDA GPU is available"))
    return c


def _watch_inputs(case: Case) -> Case:
    names = {a[1:-1] for a in case.argv if a.startswith("{") and a.endswith("}")}
    case.watch = tuple(sorted(names - {"out", "case"}))
    return case


CASES = [(f"{c.cmd}-{c.id}", c) for group in (pad_cases, tiny_pair_cases, fixtures_cases, space_cases, synth_cases,
                                                 demo_cases, push_cases, card_cases, others_cases, before_work_cases)
         for c in group()]
