"""The experiments/ scripts that convert, quantize and train, on stand-ins: quantize_exl3's archive for $OUT and its
step table when SIGTERM cuts the call, pair_mode's EXL3 drafter and its folder protocol, smol_scale's device calls run tiny on the CPU."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from toolkit.core.errors import OptionError, ToolkitError


# -- quantize_exl3: the cards archived for $OUT; the step table kept when SIGTERM cuts the call ------------------


def test_quantize_exl3_keeps_what_out_takes_back(tmp_path, monkeypatch):
    """The pair's 13 cards travel as one archive: $OUT takes back 8 files, and report.json must be among them."""
    import tarfile

    import experiments.quantize_exl3 as q
    import toolkit.quantize

    out = tmp_path / "out"
    for name in [f"{b}bpw{u}" for b in (2.0, 3.0, 4.0, 5.0, 6.0, 8.0) for u in ("", "-uncal")] + ["upstream"]:
        (out / name).mkdir(parents=True)
        (out / name / "README.md").write_text(f"card {name}")
    (out / "report.json").write_text("{}")
    (out / "report.md").write_text("report")
    monkeypatch.setattr(toolkit.quantize, "main", lambda argv, on_step=None: None)
    res = q.quantize_run(Path("r.toml"), tmp_path, tmp_path, out, tmp_path / "keep", [])
    kept = sorted(p.name for p in (tmp_path / "keep").iterdir())
    assert res["verdict"] == "pass" and kept == ["cards.tar.gz", "report.json", "report.md"]
    with tarfile.open(tmp_path / "keep" / "cards.tar.gz") as tar:
        names = tar.getnames()
        assert len(names) == 13 and tar.extractfile("card-4.0bpw.md").read() == b"card 4.0bpw"


def test_quantize_exl3_cut_off_by_sigterm_returns_its_step_table(tmp_path, pair, monkeypatch):
    import signal

    import test_quantize_fakes as fakes
    from test_quantize_pipeline import write_recipe

    import experiments.quantize_exl3 as q

    out = tmp_path / "OUT"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))     # main() sets it when unset: undone here
    work = tmp_path / "q36"                                               # what call 1 (--stage) leaves
    fakes.exl3_target(pair[0], work / "target-4.0", bits=4.0)
    shutil.copytree(pair[1], work / "draft")
    recipe = write_recipe(tmp_path / "r.toml", pair[0])
    recipe.write_text(recipe.read_text().replace("default = [2.0, 4.0, 8.0]", "default = [8.0]"))
    monkeypatch.setattr(q, "SHAPE_RECIPE", recipe)
    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    seen, inner = {}, engine.open_backend

    def cut(*a, **k):                                                      # speed starts: the call is cut off here
        seen.update(json.loads((out / "quantize_exl3.json").read_text()))
        os.kill(os.getpid(), signal.SIGTERM)
        return inner(*a, **k)

    monkeypatch.setattr(engine, "open_backend", cut)
    before = signal.getsignal(signal.SIGTERM)
    assert q.main(["shape", "--work", str(work)]) == 1
    done = ["validate", "plan", "target", "calibrate", "convert", "check"]
    assert [r["step"] for r in seen["quantize_steps"]] == done and seen["quantize_progress"]["running"] == "speed"
    res = json.loads((out / "quantize_exl3.json").read_text())
    assert [r["step"] for r in res["quantize_steps"]] == done and res["quantize_progress"]["cut_off"]["in_step"] == "speed"
    assert "SIGTERM at" in res["errors"]["quantize"] and "quantize" not in res["steps"]
    assert signal.getsignal(signal.SIGTERM) is before                   # the handler is the script's only while it runs


# -- pair_mode.exl3_draft: the converter replaced, the folder protocol checked ---------------------------------------------


def test_exl3_draft_converts_once_pins_tap_shift_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    import experiments.pair_mode as dx

    src = tmp_path / "draft"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"dflash_config": {"tap_shift": 1}}))
    (src / "heldout.json").write_text("{}")
    calls = []

    def fake(args, log):
        out = Path(args[args.index("-o") + 1])
        calls.append(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3"}}))
        return 0

    monkeypatch.setattr(dx, "run_converter", lambda args, log: 3)
    with pytest.raises(ToolkitError, match="failed \\(exit 3\\)"):
        dx.exl3_draft(src, tmp_path / "draft-6bpw", 6)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".log")) == ["draft"]
    monkeypatch.setattr(dx, "run_converter", fake)
    out = tmp_path / "draft-6bpw"
    assert dx.exl3_draft(src, out, 6) == out and dx.exl3_draft(src, out, 6) == out
    assert len(calls) == 1                                   # complete: reused
    assert json.loads((out / "config.json").read_text())["dflash_config"]["tap_shift"] == 1
    assert (out / "heldout.json").is_file() and float(calls[0][calls[0].index("-b") + 1]) == 6.0
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.work"))


# -- smol_scale: gen then train (--quick: CPU, a tiny target), the store kept and a later train continuing ---------


def test_smol_scale_runs_its_device_calls_tiny(tmp_path, monkeypatch):
    from experiments import smol_scale
    from toolkit.assets.fixtures import build
    from toolkit.train.data import Item, write_pool

    target, _ = build(tmp_path / "models", "llama", 16, 0)
    pool = [Item(f"Tell me about item number {i} in the list of things.", "chat") for i in range(200)]
    pool += [Item(f"def f{i}(x):\n    return x * {i} + 1\n", "code") for i in range(100)]
    write_pool(tmp_path / "pool.jsonl.gz", pool)
    common = ["--quick", "--target", str(target), "--work", str(tmp_path / "work")]
    monkeypatch.setenv("OUT", str(tmp_path / "out1"))
    assert smol_scale.main(["gen", *common, "--pool", str(tmp_path / "pool.jsonl.gz"), "--batch", "4"]) == 0
    gen = json.loads((tmp_path / "out1" / "gen.json").read_text())["stages"]["generate"]["result"]
    assert gen["answered"] == 8 and gen["pending"] == 0 and gen["answers_per_s"] > 0
    monkeypatch.setenv("OUT", str(tmp_path / "out2"))
    assert smol_scale.main(["train", *common]) == 0
    out = tmp_path / "out2"
    res = json.loads((out / "results.json").read_text())
    assert res["stages"]["train"]["result"]["steps"] == 6 and set(res["tau"]) == {"chat", "code"}
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and "curve.png" in names and "model-00001-of-00002.safetensors" in names
    # the store comes back as parts, is kept, and a later train unpacks it and continues the drafter
    assert [p.name for p in (tmp_path / "out1").glob("store.tar.xz.*")] == ["store.tar.xz.00"]
    smol_scale.keep_store(tmp_path / "out1", tmp_path / "kept")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(OptionError, match="not an earlier output of experiments.smol_scale keep-store"):
        smol_scale.keep_store(tmp_path / "out1", tmp_path / "theirs")
    monkeypatch.setenv("OUT", str(tmp_path / "out3"))
    later = ["--quick", "--target", str(target), "--work", str(tmp_path / "work2")]
    assert smol_scale.main(["train", *later, "--store-parts", str(tmp_path / "kept"), "--init", str(out)]) == 0
    res3 = json.loads((tmp_path / "out3" / "results.json").read_text())
    assert res3["stages"]["unpack_store"]["result"] == {"parts": 1, "index": True}
    first = lambda r: r["stages"]["train"]["result"]["losses"][0][1]
    assert first(res3) < first(res)                  # it starts where the first run ended
