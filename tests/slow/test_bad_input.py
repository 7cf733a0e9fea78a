"""Bad input never costs data, never passes silently, never ends in a traceback (issue 20).

Each case runs a command as a subprocess (`python -m toolkit.<cmd> ...`) and asserts: exit status 2; the last line
of stderr starts with `error:` and names what was wrong; no traceback; and every file under the case's folder (the
output location and anything beside it) and under the inputs it read is unchanged byte for byte, or still absent.
Cases are independent (one folder each), so they run a few at a time; fixture folders are built once per module.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bad_input_cases import CASES, Case
from broken_server import broken_server
from fuzz_harness import write_run
from test_card import sample_report

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
ROOT_USER = os.geteuid() == 0


# --- fixture folders, built once ---------------------------------------------------------------------------------

def write_header_only(path: Path, header) -> None:
    import struct

    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)


def model_variants(root: Path) -> dict[str, Path]:
    """The shipped tiny target and broken copies of it: EXL3-labelled, truncated, bad headers, bad configs."""
    out = {"model": root / "model"}
    shutil.copytree(PAIR / "target", out["model"])
    cfg = json.loads((out["model"] / "config.json").read_text())

    def variant(name: str, edit) -> None:
        out[name] = root / name
        shutil.copytree(out["model"], out[name])
        edit(out[name])

    variant("exl3", lambda d: (d / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "exl3", "bits": 4.0}})))
    variant("truncated", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-4096]))
    variant("header_list", lambda d: write_header_only(d / "model.safetensors", [1, 2]))
    variant("no_offsets", lambda d: write_header_only(d / "model.safetensors", {"w": {"dtype": "F32", "shape": [2]}}))
    variant("config_list", lambda d: (d / "config.json").write_text("[1, 2]"))
    variant("moe", lambda d: (d / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_5_moe"})))
    variant("no_config", lambda d: (d / "config.json").unlink())
    return out


def run_variants(root: Path) -> dict[str, Path]:
    """A finished quantize run (report, plot, a folder per bitrate with its card, the upstream card) and broken
    copies of it."""
    run = root / "run"
    write_run(run, sample_report(0))
    out = {"run": run}

    def variant(name: str, edit) -> None:
        out[name] = root / name
        shutil.copytree(run, out[name])
        edit(out[name])

    def report_edit(fn):
        return lambda d: (d / "report.json").write_text(json.dumps(fn(json.loads((d / "report.json").read_text()))))

    (root / "outside").mkdir()
    (root / "outside" / "secret.txt").write_text("not for upload")
    variant("run_escape", report_edit(lambda r: {**r, "results": [{**r["results"][0], "folder": "../outside"}]}))
    variant("run_incomplete", lambda d: (d / "tau_top1.png").unlink())
    variant("run_list", report_edit(lambda r: [r]))
    variant("run_badbits", report_edit(lambda r: {**r, "results": [{**r["results"][0], "bits": "four"}]}))
    variant("run_schema2", report_edit(lambda r: {**r, "schema": 2}))
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input-inputs")
    names = {**model_variants(root), **run_variants(root)}
    (root / "synth.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                 "model_type": "qwen3_5_moe", "text_config": {"hidden_size": 128}}))
    (root / "list.json").write_text("[1]")
    (root / "empty.json").write_text("")
    (root / "bad.toml").write_text('[model]\nid = 3\n')
    (root / "gguf").mkdir()
    (root / "gguf" / "fake.gguf").write_bytes(b"GGUF not really")
    (root / "gguf" / "LICENSE").write_text("Apache License\n")
    names.update(hf_home=root / "hf-home", synth_config=root / "synth.json", list_json=root / "list.json", empty_file=root / "empty.json",
                 bad_recipe=root / "bad.toml", fake_gguf=root / "gguf" / "fake.gguf")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    with broken_server() as url500:
        urls = {"url500": url500, "refused": f"http://127.0.0.1:{s.getsockname()[1]}"}
        s.close()
        yield {k: str(v) for k, v in names.items()}, urls


# --- running the cases -------------------------------------------------------------------------------------------

def snapshot(path: Path) -> dict | str | None:
    """Every file and folder under `path` with the sha256 of each file; None when absent."""
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    out = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def prepare(case: Case, folder: Path, names: dict[str, str]) -> tuple[dict, Path, dict]:
    """Make the case's folder and its output location's state; returns (placeholders, cwd, env)."""
    folder.mkdir(parents=True)
    env = {}
    out = folder / "out"
    if case.out == "unowned":
        out.mkdir()
        (out / "notes.txt").write_text("mine, not the command's")
    elif case.out == "file":
        out.write_text("a file where a folder is asked for")
    elif case.out == "under_file":
        (folder / "afile").write_text("x")
        out = folder / "afile" / "out"
    elif case.out == "unwritable":
        if ROOT_USER:
            out = Path("/proc/1/dflash-bad-input-out")
        else:
            (folder / "ro").mkdir(mode=0o500)
            out = folder / "ro" / "out"
    elif case.out == "cwd":
        (folder / "keep.txt").write_text("the current folder")
        out = Path(".")
    elif case.out == "home":
        (folder / "keep.txt").write_text("the home folder")
        env["HOME"] = str(folder)
        out = Path("~")
    elif case.out == "src_copy":
        shutil.copytree(names["model"], out)
    return {**names, "out": str(out), "case": str(folder)}, folder, env


def run_case(case: Case, folder: Path, inputs) -> dict:
    names, urls = inputs
    values, cwd, env = prepare(case, folder, {**names, **urls})
    argv = [a.format(**values) for a in case.argv]
    watched = [folder] + [Path(names[w]) for w in case.watch if w in names]
    if case.out == "unwritable" and ROOT_USER:
        watched.append(Path(values["out"]))
    before = [snapshot(p) for p in watched]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(ROOT),
           "HF_TOKEN": "", "HF_HOME": names["hf_home"], **env, **case.env}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", f"toolkit.{case.cmd}", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    return {"proc": proc, "argv": argv, "seconds": time.monotonic() - t0, "unchanged": [snapshot(p) == b for p, b in zip(watched, before)],
            "watched": watched}


@pytest.fixture(scope="module")
def results(inputs, tmp_path_factory):
    """Every case, run three at a time (each in its own folder, so they cannot disturb each other); `push` cases
    one at a time, since a push holds the shared run it publishes and refuses a second on it."""
    root = tmp_path_factory.mktemp("bad-input-cases")
    shared = threading.Lock()

    def one(case: Case, folder: Path):
        if case.cmd != "push":
            return run_case(case, folder, inputs)
        with shared:
            return run_case(case, folder, inputs)

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(one, case, root / name) for name, case in CASES}
        done = {name: f.result() for name, f in futures.items()}
    if not ROOT_USER:
        for p in root.rglob("ro"):
            p.chmod(0o755)
    return done


def test_the_suite_covers_every_command_it_can_reach():
    cmds = {c.cmd for _, c in CASES}
    assert cmds >= {"pad", "tiny_pair", "fixtures", "space", "synth", "demo", "push", "card", "bench", "eval_tau",
                    "train_drafter", "quantize", "generate"}
    assert len(CASES) >= 80 and len({name for name, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("name,case", CASES, ids=[n for n, _ in CASES])
def test_bad_input(results, name, case):
    r = results[name]
    proc = r["proc"]
    cmdline = f"python -m toolkit.{case.cmd} {' '.join(r['argv'])}"
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, f"{cmdline}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, f"{cmdline}\n{proc.stderr[-2000:]}"
    assert lines and lines[-1].startswith("error: "), f"{cmdline}: last stderr line {lines[-1:]}"
    assert case.msg in lines[-1], f"{cmdline}: {lines[-1]!r} does not say {case.msg!r}"
    changed = [str(p) for p, same in zip(r["watched"], r["unchanged"]) if not same]
    assert not changed, f"{cmdline} changed {changed}"


@pytest.mark.parametrize("argv", [["pad"], ["tiny_pair"], ["fixtures"], ["space", "export"], ["synth"],
                                  ["demo", "prepare"], ["demo"], ["push"], ["card"], ["bench"], ["eval_tau"],
                                  ["train_drafter"], ["quantize"]], ids=" ".join)
def test_help_points_to_the_output_policy(argv):
    proc = subprocess.run([sys.executable, "-m", f"toolkit.{argv[0]}", *argv[1:], "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "docs/outputs.md" in " ".join(proc.stdout.split()), proc.stdout[-500:]
