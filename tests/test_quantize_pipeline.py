"""End to end on the shipped trained tiny pair (conftest `pair`) with only the exllamav3 subprocess faked."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import test_quantize_fakes as quantize_fakes
from toolkit.core.errors import ToolkitError
from toolkit.quant import QuantizeOptions, quantize
from toolkit.quantize import main

# The shipped pair answers stdlib names with their docstrings: prompts from its domain, calibration and check disjoint.
CAL = ["json.dumps", "textwrap.wrap", "shutil.copy", "random.choice"]
HELD = ["pathlib.Path", "argparse.ArgumentParser", "csv.reader"]


def write_recipe(path, target, thresholds='default = { min_top1 = 0.01 }', cal=CAL, held=HELD):
    path.write_text(
        f'[model]\nid = "test/tiny-dflash"\nrevision = "abc123"\n[target]\nid = "{target}"\n'
        f'[bits]\ndefault = [2.0, 4.0, 8.0]\n[calibration]\nanchors_per_prompt = 3\nprompts = {json.dumps(cal)}\n'
        f'[check]\nmax_new_tokens = 6\ntap_shift_candidates = [0, 1]\nprompts = {json.dumps(held)}\n'
        f'[thresholds]\n{thresholds}\n"8.0" = {{ min_top1 = 0.95 }}\n'
    )
    return path


def run(tmp_path, pair, **kw):
    t, d = pair
    args = dict(recipe=str(write_recipe(tmp_path / "r.toml", t)), model=str(d), out=str(tmp_path / "out"), device="cpu")
    args.update(kw)
    return quantize(QuantizeOptions(**args), progress=False)


def test_end_to_end_calibrated_and_uncalibrated(tmp_path, pair, monkeypatch):
    calls = quantize_fakes.install(monkeypatch)
    report = run(tmp_path, pair, bits="2,8", also_uncalibrated=True)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "2.0bpw", "2.0bpw-uncal", "8.0bpw", "8.0bpw-uncal", "report.json", "report.md", "tau_top1.png"]
    # calibrated rows got the Hessian folder, uncalibrated ones did not
    assert {(c["bits"], c["hessians"] is not None) for c in calls} == {(2.0, True), (2.0, False), (8.0, True), (8.0, False)}
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == report
    assert set(report) == {"schema", "model", "revision", "target", "created", "toolkit_version", "exllamav3_version",
                           "block_size", "tap_shift", "device", "bf16", "results", "model_sha", "target_sha",
                           "target_kind", "recommended_draft_tokens", "exl3_widths", "steps", "memory",
                           "target_model", "model_local", "target_local"}
    # a local BF16 target: no shas, the torch runtime's tau, nothing measured on exllamav3
    assert report["model_sha"] is None and report["target_sha"] is None and report["target_kind"] == "hf"
    assert report["target_local"] is True and report["model_local"] is False    # the recipe names the drafter
    assert report["bf16"]["exl3"] is None and report["recommended_draft_tokens"] is None and report["exl3_widths"] == []
    assert [s["step"] for s in report["steps"]] == ["validate", "plan", "target", "calibrate", "convert", "check", "speed"]
    assert all(s["seconds"] >= 0 for s in report["steps"]) and report["memory"]["card_budget_bytes"] == 22 * 1024**3
    assert report["schema"] == 1 and report["model"] == "test/tiny-dflash" and report["revision"] == "abc123"
    assert report["block_size"] == 16 and report["tap_shift"] == 0      # the pair was trained with tap_shift 0
    assert isinstance(report["bf16"]["size_bytes"], int) and report["bf16"]["size_bytes"] > 0
    assert report["bf16"]["tau"] >= 1.0
    for r in report["results"]:
        assert set(r) == {"bits", "branch", "folder", "size_bytes", "calibrated", "kl", "kl_per_position", "top1",
                          "top1_per_position", "tau", "exl3", "passed"}
        assert r["exl3"] is None
        assert len(r["kl_per_position"]) == len(r["top1_per_position"]) == 15    # B - 1 drafted positions
        assert r["size_bytes"] == (out / r["folder"] / "model.safetensors").stat().st_size
        assert r["passed"] is True and r["tau"] >= 1.0
    by = {r["folder"]: r for r in report["results"]}
    # the fake converter's per-row grid is cruder than exllamav3's trellis: 0.99 is the device target, 0.95 here
    assert by["8.0bpw"]["top1"] >= 0.95 and by["8.0bpw"]["kl"] < by["2.0bpw"]["kl"]
    assert by["8.0bpw"]["top1"] > by["2.0bpw"]["top1"]
    assert by["2.0bpw-uncal"]["calibrated"] is False and by["2.0bpw-uncal"]["branch"] == "2.0bpw-uncal"
    cfg = json.loads((out / "8.0bpw" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "exl3"
    assert cfg["dflash_config"]["target_layer_ids"] and cfg["dflash_config"]["tap_shift"] == report["tap_shift"]
    md = (out / "report.md").read_text()
    assert "8.0bpw-uncal" in md and "not pushed" in md
    assert (out / "tau_top1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_norms_kept_unquantized(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch)
    run(tmp_path, pair, bits="2", check=False)
    src = load_file(pair[1] / "model.safetensors")
    out = load_file(tmp_path / "out" / "2.0bpw" / "model.safetensors")
    assert torch.allclose(out["hidden_norm.weight"].float(), src["hidden_norm.weight"].float(), atol=1e-3)
    assert not torch.allclose(out["fc.weight"].float(), src["fc.weight"].float(), atol=1e-3)


def test_model_card_per_output(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch)
    t, d = pair
    main(["--recipe", str(write_recipe(tmp_path / "r.toml", t)), "--model", str(d), "--out", str(tmp_path / "out"),
          "--device", "cpu", "--bits", "4", "--no-check"])
    card = (tmp_path / "out" / "4.0bpw" / "README.md").read_text()
    assert "base_model: test/tiny-dflash" in card and "base_model_relation: quantized" in card
    assert "library_name: exllamav3" in card and "tags:" in card


def test_resume_skips_finished_and_redoes_crashed(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch, {4.0: "crash"})
    with pytest.raises(ToolkitError, match=r"converter crashed on 4.0bpw \(exit -11"):
        run(tmp_path, pair, check=False, calibrate=False)
    out = tmp_path / "out"
    assert (out / "2.0bpw" / ".quantize.json").is_file()
    assert not (out / "4.0bpw").exists() and not (out / ".4.0bpw.partial").exists()
    calls = quantize_fakes.install(monkeypatch)
    run(tmp_path, pair, check=False, calibrate=False)
    assert [c["bits"] for c in calls] == [4.0, 8.0]                   # 2.0 was finished and skipped
    assert all((out / f / ".quantize.json").is_file() for f in ("2.0bpw", "4.0bpw", "8.0bpw"))


def test_half_written_folder_is_redone(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch)
    run(tmp_path, pair, bits="2,4", check=False, calibrate=False)
    (tmp_path / "out" / "4.0bpw" / ".quantize.json").unlink()          # as if the run died before the stamp
    calls = quantize_fakes.install(monkeypatch)
    run(tmp_path, pair, bits="2,4", check=False, calibrate=False)
    assert [c["bits"] for c in calls] == [4.0]


def test_disk_full_during_conversion(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch, {2.0: "disk"})
    with pytest.raises(ToolkitError, match="disk full while converting 2.0bpw") as e:
        run(tmp_path, pair, bits="2", check=False, calibrate=False)
    assert "\n" not in str(e.value)
    assert [p.name for p in (tmp_path / "out").iterdir() if "2.0bpw" in p.name] == []


def test_disk_full_in_our_writer(tmp_path, pair, monkeypatch):
    import errno

    from toolkit.core import folders

    quantize_fakes.install(monkeypatch)
    real = folders.atomic_write

    def full(path, write, need=None):        # the disk fills while a bitrate's config.json is rewritten
        if path.name == "config.json":
            def write(f):
                f.write(b"{")
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, write, need)

    monkeypatch.setattr(folders, "atomic_write", full)
    with pytest.raises(ToolkitError, match="^no space left on the device writing .*config.json"):
        run(tmp_path, pair, bits="2", check=False, calibrate=False)
    assert not any("2.0bpw" in p.name for p in (tmp_path / "out").iterdir())
    assert not any(".tmp-" in p.name for p in (tmp_path / "out").rglob("*"))      # no partial temp file


def test_converter_refusal_is_one_line(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch, {2.0: "refuse"})
    with pytest.raises(ToolkitError, match="converter refused 2.0bpw: Error: --bits must be between 1 and 8"):
        run(tmp_path, pair, bits="2", check=False, calibrate=False)


def test_thresholds_fail_with_nonzero_exit(tmp_path, pair, monkeypatch, capsys):
    quantize_fakes.install(monkeypatch)
    t, d = pair
    recipe = write_recipe(tmp_path / "r.toml", t, thresholds='default = { min_top1 = 0.999, max_kl = 0.0001 }')
    with pytest.raises(SystemExit) as e:
        from toolkit.core.errors import run_cli
        run_cli(lambda: main(["--recipe", str(recipe), "--model", str(d), "--out", str(tmp_path / "out"),
                              "--bits", "2", "--no-calibrate", "--device", "cpu"]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: below the recipe's thresholds: 2.0bpw: top-1")
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["results"][0]["passed"] is False
    assert (tmp_path / "out" / "2.0bpw" / "README.md").is_file()       # the card is written for a failing run too


def test_out_exists_without_force(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ToolkitError, match="exists and is not a resumable run.*--force"):
        run(tmp_path, pair, bits="2", check=False, calibrate=False)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    run(tmp_path, pair, bits="2", check=False, calibrate=False, force=True)
    assert not (tmp_path / "out" / "notes.txt").exists() and (tmp_path / "out" / "2.0bpw").is_dir()


def test_force_replaces_out_only_once_complete(tmp_path, pair, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    quantize_fakes.install(monkeypatch, {4.0: "crash"})
    with pytest.raises(ToolkitError, match="converter crashed on 4.0bpw"):
        run(tmp_path, pair, bits="2,4", check=False, calibrate=False, force=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []     # no half-built folder left
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    quantize_fakes.install(monkeypatch)
    run(tmp_path, pair, bits="2,4", check=False, calibrate=False, force=True)
    assert not (out / "notes.txt").exists() and (out / "4.0bpw" / ".quantize.json").is_file()
    assert (out / ".work").is_dir() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_the_pipeline_does_not_publish():
    """quant/ is a library: model cards and the push are hub/'s, composed by the toolkit.quantize command."""
    import ast
    from pathlib import Path

    for path in (Path(__file__).resolve().parents[1] / "toolkit" / "quant").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "hub" not in (node.module or "").split("."), f"{path} imports {node.module}"


def test_no_gpu_says_so(tmp_path, pair, monkeypatch):
    import toolkit.quant.convert as conv

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ToolkitError, match="no CUDA GPU.*--dry-run"):
        run(tmp_path, pair, bits="2", check=False, calibrate=False)
    assert conv.converter_unavailable().startswith("no CUDA GPU")
    assert not (tmp_path / "out").exists()


def test_check_prompts_must_be_held_out(tmp_path, pair, monkeypatch):
    quantize_fakes.install(monkeypatch)
    t, d = pair
    recipe = write_recipe(tmp_path / "r.toml", t, held=[CAL[0]])
    with pytest.raises(ToolkitError, match="must be held out"):
        quantize(QuantizeOptions(recipe=str(recipe), model=str(d), out=str(tmp_path / "out"), bits="2", device="cpu"),
                 progress=False)


def test_overrides_become_an_exllamav3_recipe(tmp_path, pair, monkeypatch):
    calls = quantize_fakes.install(monkeypatch)
    t, d = pair
    r = write_recipe(tmp_path / "r.toml", t)
    r.write_text(r.read_text() + '[overrides]\n"fc" = 8\n')
    quantize(QuantizeOptions(recipe=str(r), model=str(d), out=str(tmp_path / "out"), bits="4", calibrate=False,
                             check=False, device="cpu"), progress=False)
    text = open(calls[0]["recipe"]).read()
    assert "'*': 4" in text and "'fc': 8" in text and "target_bpw: 4.0" in text
    with pytest.raises(ToolkitError, match="4.25 cannot be combined with per-tensor overrides"):
        quantize(QuantizeOptions(recipe=str(r), model=str(d), out=str(tmp_path / "out"), bits="4.25", calibrate=False,
                                 check=False, device="cpu"), progress=False)
