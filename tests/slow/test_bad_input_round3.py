"""Bad input, round three: the cases a hostile user found, each as a test, and the mechanisms behind them.
Commands run in-process under core.errors.run_cli with their heavy work stubbed (fuzz_harness's STUBS): "reached"
means the checks passed and the work began, so a refusal that comes before it came before any model was loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fuzz_harness import fill, inputs, main_of, make_case, run_case, signature, stubs, write_run  # noqa: F401
from fuzz_options import ROLES, with_value
from test_card import sample_report
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.costs.cache import cached_costs
from toolkit.costs.table import CostTable

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
BIG = 10**400                                             # valid JSON; no float holds it


def cli(cmd: str, argv: list[str], folder: Path, monkeypatch, app_main=None) -> dict:
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


# --- 1. numbers out of range ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit", [["ms", "1", "0"], ["ms", "1", "1"], ["ms", "4"], ["ms", "1", "-3"],
                                  ["ms", "1", "99999999999999"]])
def test_a_cost_cache_entry_out_of_range_is_timed_again(tmp_path, edit):
    from toolkit.costs.book import RoundCosts

    d = {"device": "cpu", "ms": {"1": {"0": 1.0, "1": 2.0}, "4": {"0": 2.0, "3": 3.0}}}
    node = d
    for k in edit[:-1]:
        node = node[k]
    node[edit[-1]] = BIG                                    # a value or a whole row 401 digits long, or a key past range
    (tmp_path / "k.json").write_text(json.dumps(d))
    timed = []
    table = cached_costs("k", lambda: timed.append(1) or CostTable({1: {0: 1.5, 1: 2.5}}), tmp_path)
    assert timed and table.source == "timed now" and RoundCosts(table, 8).curve(1)[0] == 1.5
    again = cached_costs("k", lambda: pytest.fail("the re-timed table was not kept"), tmp_path)
    assert again.ms == table.ms


def test_generate_recovers_from_a_huge_cost_cache_entry(tmp_path):
    costs, env = tmp_path / "costs", {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env["DFLASH_COST_CACHE"] = str(costs)
    run = lambda: subprocess.run([sys.executable, "-m", "toolkit.generate", "--prompt", "hi", "--max-new-tokens", "4"],  # noqa: E731
                                 cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    key = subprocess.run([sys.executable, "-c", "from toolkit.generate import load; from toolkit.costs.cache import "
                          "cost_key as k; b = load('torch', None, None); print(k(b.folders, b.target.device, "
                          "b.target.dtype, b.block_size))"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300).stdout.split()[-1]     # as generate's process keys it (threads are in the key)
    costs.mkdir()
    (f := costs / f"{key}.json").write_text(json.dumps({"ms": {"1": {"0": BIG, "15": 2.0}}, "rounds": {}}))
    r = run()
    assert r.returncode == 0 and "Traceback" not in r.stderr and "round costs: timed now" in r.stderr, r.stderr[-1500:]
    assert not f.exists() or json.loads(f.read_text())["ms"]["1"]["0"] < 1e9     # gone, or timed again and kept


@pytest.mark.parametrize("where,key,words", [
    ("row", "bits", "results[0].bits must be a number from 1 to 8 bits per weight, got a 401-digit integer"),
    ("row", "tau", "results[0].tau must be a number from 0 to 1024 tokens per round (or null)"),
    ("row", "size_bytes", "results[0].size_bytes must be a whole number from 0 to"),
    ("row", "kl", "results[0].kl must be"), ("row", "top1", "results[0].top1 must be"),
    ("bf16", "tau", "bf16.tau must be"), ("report", "block_size", "block_size must be"),
    ("exl3", "speedup", "results[0].exl3.speedup must be")])
@pytest.mark.parametrize("cmd", ["card", "push"])
def test_report_numbers_out_of_range_are_one_line(tmp_path, monkeypatch, stubs, where, key, words, cmd):
    report = sample_report(0)
    node = {"row": report["results"][0], "bf16": report["bf16"], "report": report}.get(where)
    if where == "exl3":
        node = report["results"][0]["exl3"] = {"tau": 3.0}
    node[key] = BIG
    write_run(tmp_path / "run", report)
    before = signature(tmp_path / "run")
    argv = ["--from", str(tmp_path / "run")] + (["--repo", "a/b", "--dry-run"] if cmd == "push" else [])
    refused(cli(cmd, argv, tmp_path / "c", monkeypatch), "report.json", words)
    assert signature(tmp_path / "run") == before


RECIPE = ROOT / "quantize" / "smollm2-135m-dflash.toml"


@pytest.mark.parametrize("line,words", [
    ("tap_shift_candidates = [-100, 99999]", "check.tap_shift_candidates[0] must be a whole number from -64 to 64"),
    ("tap_shift_candidates = [40, 50]", "each of check.tap_shift_candidates [40, 50] puts a tap outside"),
    ("tap_shift_candidates = []", "check.tap_shift_candidates must be a non-empty list"),
    ("max_new_tokens = 1" + "0" * 30, "check.max_new_tokens must be a whole number from 1 to 65536"),
    ("draft_tokens = [0]", "check.draft_tokens[0] must be a whole number from 1 to 1024")])
def test_recipe_numbers_out_of_range_are_refused_before_work(tmp_path, monkeypatch, stubs, line, words):
    key, text = line.split(" = ")[0], RECIPE.read_text()
    if re.search(rf"^{key} = ", text, re.M):
        text = re.sub(rf"^{key} = .*$", line, text, count=1, flags=re.M)
    else:
        text = text.replace("tap_shift_candidates = [0, 1]", f"tap_shift_candidates = [0, 1]\n{line}")
    (tmp_path / "r.toml").write_text(text)
    argv = ["--recipe", str(tmp_path / "r.toml"), "--model", str(PAIR / "draft"), "--target", str(PAIR / "target"),
            "--out", str(tmp_path / "out"), "--dry-run"]
    refused(cli("quantize", argv, tmp_path / "c", monkeypatch), words)
    assert not (tmp_path / "out").exists()


def test_the_number_validator_compares_huge_integers_exactly():
    from toolkit.core.files import Num, number, shown

    n = Num(0, 1e15, "ms")
    for bad in (BIG, -BIG, math.inf, math.nan, True, "1", None, [1]):
        with pytest.raises(ToolkitError, match=r"^f: k must be a number from 0 to 1e\+15 ms, got "):
            number(bad, n, "f", "k")
    assert number(10**15, n, "f", "k") == 10**15 and number(None, Num(0, 1, null=True), "f", "k") is None
    assert shown(BIG) == "a 401-digit integer" and len(shown("x" * 500)) == 40


# --- 2. and 3. writes that never follow a link, checked before the work ----------------------------------------------

def write_card_argv(draft: Path, heldout: Path) -> list[str]:
    return ["--target", str(PAIR / "target"), "--draft", str(draft), "--heldout", str(heldout), "--max-new-tokens", "4",
            "--block-sizes", "4", "--quiet", "--write-card"]


@pytest.mark.parametrize("readme", ["link-to-config", "link-out", "not-utf8", "folder"])
def test_write_card_is_checked_before_the_evaluation(tmp_path, monkeypatch, stubs, readme):
    draft, held = tmp_path / "draft", tmp_path / "held.json"
    shutil.copytree(PAIR / "draft", draft)
    held.write_text(json.dumps({"chat": ["hi"], "code": ["def f():"]}))
    (tmp_path / "other.md").write_text("someone else's\n")
    (draft / "README.md").unlink()
    {"link-to-config": lambda p: p.symlink_to("config.json"), "link-out": lambda p: p.symlink_to(tmp_path / "other.md"),
     "not-utf8": lambda p: p.write_bytes(b"caf\xe9\n"), "folder": lambda p: p.mkdir()}[readme](draft / "README.md")
    (tmp_path / "c").mkdir()
    before = signature(tmp_path)
    r = cli("eval_tau", write_card_argv(draft, held), tmp_path / "c", monkeypatch)
    refused(r, "--write-card", "README.md")
    assert signature(tmp_path) == before


@pytest.fixture
def read_only(tmp_path):
    """A folder that cannot be written: a read-only tmpfs (root), else a folder without write permission."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "draft").mkdir()
    if os.geteuid() != 0:
        shutil.copytree(PAIR / "draft", ro / "draft", dirs_exist_ok=True)
        ro.chmod(0o555), (ro / "draft").chmod(0o555)
        yield ro
        ro.chmod(0o755), (ro / "draft").chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here")
    try:
        shutil.copytree(PAIR / "draft", ro / "draft")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, capture_output=True)
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


OUTPUTS = sorted((cmd, name) for cmd, roles in ROLES.items() for name, role in roles.items() if role.startswith("out_"))


def test_every_output_option_is_walked():
    assert {c for c, _ in OUTPUTS} == {"bench", "demo", "eval_tau", "fixtures", "pad", "preview_run", "quantize", "space", "synth",
                                        "tiny_pair", "train_drafter"}


@pytest.mark.parametrize("cmd,name", OUTPUTS + [("eval_tau", "write_card")], ids=lambda x: str(x))
def test_a_bad_output_place_fails_before_any_work(cmd, name, inputs, stubs, read_only, tmp_path, monkeypatch):
    """A read-only place (or a read-only drafter for --write-card) is one line, before any model is loaded."""
    names, _ = inputs
    make_case(tmp_path / "c")
    if name == "write_card":
        argv = write_card_argv(read_only / "draft", Path(names["heldout"]))
    else:
        value = str(read_only / ("new.png" if name == "curve" else "new.json" if ROLES[cmd][name] == "out_file" else "new"))
        argv = [fill(a, {**names, "case": str(tmp_path / "c")}) for a in with_value(cmd, name, value)]
    r = run_case(main_of(cmd, None), argv, tmp_path / "c", monkeypatch)
    assert r["exc"] is None and r["code"] == 2, (argv, r)
    assert "cannot write" in r["stderr"].strip().splitlines()[-1], r["stderr"]


def test_no_writer_follows_a_link(tmp_path):
    """Every writer, given a destination that is a symbolic link (inside its folder or out of it), refuses it and
    changes neither the link nor what it points to."""
    from toolkit.core import checksums
    from toolkit.core.folders import MARKER, atomic_dir, atomic_file, atomic_write, claim, claim_file, mark
    from toolkit.dflash.loading import load_drafter, save_drafter
    from toolkit.hub.push import write_cards
    from toolkit.quant.convert import write_text
    from toolkit.train.outputs import save_torch, write_curve

    victim = tmp_path / "victim.txt"
    victim.write_text("the user's\n")
    run = tmp_path / "run"
    write_run(run, sample_report(0))
    model = load_drafter(PAIR / "draft")

    def dir_writer(path):
        with atomic_dir(path):
            pass

    def fig_writer(path):
        from matplotlib.figure import Figure
        write_curve(Figure(), path)

    writers = {"atomic_file": lambda p: atomic_file(p, "x"), "atomic_write": lambda p: atomic_write(p, lambda f: f.write(b"x")),
               "atomic_dir": dir_writer, "claim": lambda p: claim(p, "pad", True), "claim_file": lambda p: claim_file(p),
               "mark": lambda p: mark(p.parent, "pad"), "convert.write_text": lambda p: write_text(p, "x"),
               "save_torch": lambda p: save_torch({"a": 1}, p), "curve": fig_writer,
               "save_drafter": lambda p: save_drafter(model, p)}
    for name, write in writers.items():
        for target in (victim, Path("victim.txt")):           # out of the folder, and a relative link beside it
            folder = tmp_path / f"w-{name}"
            folder.mkdir(exist_ok=True)
            dest = folder / (MARKER if name == "mark" else "out")
            dest.unlink(missing_ok=True)
            (folder / "victim.txt").write_text("mine\n")
            dest.symlink_to(target)
            with pytest.raises((ToolkitError, OptionError), match="symbolic link"):
                write(dest)
            assert dest.is_symlink() and victim.read_text() == "the user's\n"
            assert (folder / "victim.txt").read_text() == "mine\n", name
    # writers that keep going: a cost cache and a cache's memory of checked files are left as they are
    (tmp_path / "costs").mkdir()
    (tmp_path / "costs" / "k.json").symlink_to(victim)
    cached_costs("k", lambda: CostTable({1: {0: 1.0, 1: 2.0}}), tmp_path / "costs")
    (tmp_path / "c" / "f").parent.mkdir()
    (tmp_path / "c" / "f").write_text("f")
    (tmp_path / "c" / checksums.SEEN).symlink_to(victim)
    assert checksums.proven(tmp_path / "c", {"f": {"size": 1, "sha256": sha("f")}})
    # push's cards in the bitrate folders
    readme = run / sample_report(0)["results"][0]["folder"] / "README.md"
    readme.unlink()
    readme.symlink_to(victim)
    with pytest.raises(ToolkitError, match="symbolic link"):
        write_cards(run)
    assert victim.read_text() == "the user's\n" and readme.is_symlink()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# --- 4. copies that cannot loop; the kinds of --target and --draft --------------------------------------------------

@pytest.mark.parametrize("case,words", [
    ("loop", "is a link to ..; a copied folder may link only to files inside it"),
    ("link-out", "a copied folder may link only to files inside it"), ("not-a-model", "has no config.json"),
    ("swapped", "is a DFlash drafter, not a target model"), ("draft-is-target", "is an HF model"),
    ("no-architecture", "names no architectures or model_type: not a model folder")])
def test_space_export_refuses_what_it_cannot_copy_or_serve(tmp_path, monkeypatch, stubs, case, words):
    t, d = tmp_path / "t", tmp_path / "d"
    shutil.copytree(PAIR / "target", t)
    shutil.copytree(PAIR / "draft", d)
    (tmp_path / "secret.txt").write_text("secret")
    edit = {"loop": lambda: ((t / "sub").mkdir(), (t / "sub" / "loop").symlink_to("..")),
            "link-out": lambda: (t / "notes.txt").symlink_to(tmp_path / "secret.txt"),
            "not-a-model": lambda: (t / "config.json").unlink(),
            "swapped": lambda: None, "draft-is-target": lambda: None,
            "no-architecture": lambda: (t / "config.json").write_text("{}")}
    edit[case]()
    target, draft = (d, t) if case == "swapped" else (t, t) if case == "draft-is-target" else (t, d)
    r = cli("space", ["export", str(tmp_path / "sp"), "--target", str(target), "--draft", str(draft),
                      "--hardware", "cpu-basic"], tmp_path / "c", monkeypatch)
    refused(r, words)
    assert not (tmp_path / "sp").exists()


def test_a_tree_copy_copies_a_link_to_a_file_inside_it_as_that_file(tmp_path):
    from toolkit.core.folders import copy_tree

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "w.bin").write_bytes(b"w")
    (src / "link.bin").symlink_to("a/w.bin")
    (src / ".hidden").write_text("h")
    copy_tree(src, tmp_path / "dst", shutil.ignore_patterns(".*"))
    got = sorted(str(p.relative_to(tmp_path / "dst")) for p in (tmp_path / "dst").rglob("*"))
    assert got == ["a", "a/w.bin", "link.bin"] and not (tmp_path / "dst" / "link.bin").is_symlink()


# --- 5. caches prove themselves; models with non-finite weights are refused ---------------------------------------

def demo_folder(folder: Path) -> None:
    from toolkit.assets import smollm2
    from toolkit.core.folders import mark, sha256

    shutil.copytree(PAIR / "target", folder)
    record = {p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in folder.iterdir()}
    (folder / smollm2.MARKER).write_text(json.dumps({"source": "x", "source_sha256": "0" * 64, "files": record}))
    mark(folder, "demo")


def test_the_demo_cache_is_trusted_only_while_its_checksums_match(tmp_path, monkeypatch):
    from toolkit.assets import smollm2
    from toolkit.core import checksums

    demo_folder(tmp_path / "demo")
    hashed = []
    real = checksums.sha256
    monkeypatch.setattr(checksums, "sha256", lambda p: hashed.append(Path(p).name) or real(p))
    assert smollm2.complete(tmp_path / "demo") is not None and "model.safetensors" in hashed
    hashed.clear()
    assert smollm2.complete(tmp_path / "demo") is not None and hashed == []          # remembered: no hash again
    weights = tmp_path / "demo" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\x00\x7e" * 32                                                       # NaN bytes, the same size
    weights.write_bytes(bytes(data))
    assert smollm2.complete(tmp_path / "demo") is None and "model.safetensors" in hashed
    monkeypatch.setattr(smollm2, "convert", lambda *a: (_ for _ in ()).throw(ToolkitError("converting again")))
    monkeypatch.setattr(smollm2, "locate_source", lambda *a: (tmp_path / "demo" / "config.json", "lic"))
    monkeypatch.setattr(smollm2, "GGUF_SHA256", real(tmp_path / "demo" / "config.json"))
    with pytest.raises(ToolkitError, match="converting again"):                          # not "cached": converted again
        smollm2.prepare(out=str(tmp_path / "demo"))


def nan_model(src: Path, dst: Path, name: str) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    key = next(k for k in tensors if name in k)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_model_with_non_finite_weights_is_refused(tmp_path, role):
    from toolkit.runtime.factory import load_backend

    nan_model(PAIR / role, tmp_path / role, "norm")
    pair = {"target": PAIR / "target", "draft": PAIR / "draft", role: tmp_path / role}
    with pytest.raises(ToolkitError, match=f"^--{role}: .*tensor '.*norm.*' has non-finite weights"):
        load_backend("torch", str(pair["target"]), str(pair["draft"]), device="cpu", dtype=torch.float32)


# --- the minor ones -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template", ["{bits.foo}", "{bits[0]}", "{x}", "{bits:d}", "{", "{bits:>999999999}"])
def test_a_branch_template_that_cannot_be_formatted_is_one_line(tmp_path, monkeypatch, stubs, template):
    write_run(tmp_path / "run", sample_report(0))
    r = cli("push", ["--repo", "a/b", "--from", str(tmp_path / "run"), "--dry-run", "--branch-template", template],
            tmp_path / "c", monkeypatch)
    refused(r, "--branch-template")


@pytest.mark.parametrize("argv,words", [
    (["--prompt", "hi", "--block-size", "4", "--retime-costs"], "--retime-costs applies only with --block-size auto"),
    (["--prompt", "hi", "--target", "x" * 300], "a file name is too long")])
def test_generate_refuses_what_it_would_ignore(tmp_path, monkeypatch, stubs, argv, words):
    refused(cli("generate", argv, tmp_path / "c", monkeypatch), words)


def test_a_file_named_unseen_is_not_silently_ignored(tmp_path, monkeypatch, stubs):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "unseen").write_text("{}")
    r = cli("eval_tau", ["--target", str(PAIR / "target"), "--draft", str(PAIR / "draft"), "--heldout", "unseen"],
            tmp_path / "c", monkeypatch)
    refused(r, "--heldout", "pass ./unseen for the file")


def test_the_curve_error_names_a_png(tmp_path, monkeypatch, stubs):
    (tmp_path / "c" / "d").mkdir(parents=True)
    r = cli("train_drafter", ["--target", str(PAIR / "target"), "--out", str(tmp_path / "c" / "new"), "--curve",
                              str(tmp_path / "c" / "d")], tmp_path / "c", monkeypatch)
    refused(r, "is a folder: name a PNG file")


def test_a_relative_cache_home_is_ignored(monkeypatch, tmp_path):
    from toolkit.core.folders import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", "rel")
    assert cache_root() == Path.home() / ".cache" / "dflash-toolkit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "dflash-toolkit"
