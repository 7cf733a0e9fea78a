"""Bad input: output places that are links or cannot be written (checked before any work), copies that cannot loop,
caches that must prove themselves, and models with non-finite weights.
Commands run in-process under core.errors.run_cli with their heavy work stubbed (fuzz_harness's STUBS): "reached"
means the checks passed and the work began, so a refusal that comes before it came before any model was loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fuzz_harness import cli, fill, inputs, main_of, make_case, refused, run_case, signature, stubs, write_run  # noqa: F401  (fixtures)
from fuzz_options import ROLES, with_value
from test_card import sample_report
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.costs.cache import cached_costs
from toolkit.costs.table import CostTable

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"


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
    from toolkit.core.copying import copy_tree

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
