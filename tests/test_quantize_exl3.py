"""quantize with an EXL3 target on CPU: exllamav3 faked at its one seam (engine.ENGINE, test_quantize_fakes.FakeEngine,
the converter at run_converter), the refusals, the report and the card (the memory plan: test_quantize_memory.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import test_quantize_fakes as fakes
from test_quantize_pipeline import write_recipe
from toolkit.core.errors import ToolkitError, run_cli
from toolkit.quant import QuantizeOptions, quantize
from toolkit.quant import speed as spd
from toolkit.quantize import main

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
EXL3_KEYS = {"tau", "accept_per_position", "tok_s", "ar_tok_s", "speedup", "lossless", "first_diff", "target",
             "target_bits", "draft_tokens", "tokens", "seconds"}


def one_line(e) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def run(tmp_path, pair, target, out="out", **kw):
    args = dict(recipe=str(write_recipe(tmp_path / "r.toml", pair[0])), model=str(pair[1]), target=str(target),
                out=str(tmp_path / out), device="cpu", bits="2,8")
    args.update(kw)
    return quantize(QuantizeOptions(**args), progress=False)


@pytest.fixture
def exl3(tmp_path, pair):
    return fakes.exl3_target(pair[0], tmp_path / "tiny-exl3", bits=4.0)


def test_exl3_target_end_to_end(tmp_path, pair, exl3, monkeypatch):
    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    report = run(tmp_path, pair, exl3, also_uncalibrated=True)
    assert report["target_kind"] == "exl3" and report["target"] == str(exl3) and report["target_sha"] is None
    # the target ran once for the prompts and was unloaded before conversion; then loaded once more with the BF16
    # drafter, and every bitrate swapped into that load, one at a time
    folders = [r["folder"] for r in report["results"]]
    assert engine.events[:2] == ["open_target", "close_target"]
    assert [e for e in engine.events if e.startswith("convert:")] == [f"convert:.{f}.partial" for f in folders]
    chain = ["bf16-reference", *folders]
    assert engine.events[2 + len(folders):] == ["open_backend:bf16-reference",
                                                *[f"swap:{a}->{b}" for a, b in zip(chain, chain[1:])],
                                                f"close_backend:{folders[-1]}"]
    assert len(engine.calls) == 2 and engine.calls[0]["target"] == exl3 and engine.calls[1]["max_concurrency"] == 1
    # tau and speed per bitrate on the engine, the BF16 drafter as reference, the width sweep and its pick
    sweep = report["exl3_widths"]
    # (the tiny pair fills a window of 3 but never one of 7: 15 would accept the same tokens, and is skipped)
    assert [c["draft_tokens"] for c in sweep] == [3, 7]
    assert spd.window_filled(sweep[0], 3) and not spd.window_filled(sweep[1], 7)
    best = max(sweep, key=lambda c: (c["speedup"], -c["draft_tokens"]))
    assert report["recommended_draft_tokens"] == best["draft_tokens"] and report["bf16"]["exl3"] == best
    for row in [report["bf16"], *report["results"]]:
        x = row["exl3"]
        assert set(x) == EXL3_KEYS and x["target"] == str(exl3) and x["target_bits"] == 4.0
        assert x["draft_tokens"] == report["recommended_draft_tokens"] and x["tau"] >= 1.0
        assert len(x["accept_per_position"]) == x["draft_tokens"] and x["lossless"] == 1.0
        assert x["first_diff"] == [None] * len(x["first_diff"]) and x["first_diff"]
        assert x["tok_s"] > 0 and x["ar_tok_s"] > 0 and x["speedup"] == pytest.approx(x["tok_s"] / x["ar_tok_s"])
        assert row["tau"] is None                   # the torch-runtime tau is the BF16 target's
    # the checked tap_shift reaches exllamav3: pinned in each folder and in the BF16 drafter's shadow config
    out = tmp_path / "out"
    ref_cfg = json.loads((out / ".work" / "bf16-reference" / "config.json").read_text())
    assert ref_cfg["dflash_config"]["tap_shift"] == report["tap_shift"] == 0
    assert json.loads((pair[1] / "config.json").read_text())["dflash_config"]["tap_shift"] == 0   # untouched
    assert [s["step"] for s in report["steps"]] == ["validate", "plan", "target", "calibrate", "convert", "check", "speed"]
    assert {s["step"]: s["estimated_bytes"] is not None for s in report["steps"]}["speed"]
    # the target step's phases, each timed (no CUDA here: no memory); no other step has any
    tgt = report["steps"][2]
    assert [p["phase"] for p in tgt["phases"]] == ["load", "continue", "forward", "parts"]
    assert all(p["seconds"] >= 0 and p["peak_allocated_bytes"] is None is p["peak_device_bytes"] for p in tgt["phases"])
    assert sum(p["seconds"] for p in tgt["phases"]) <= tgt["seconds"] + 0.05
    assert [s["step"] for s in report["steps"] if "phases" in s] == ["target"]
    # its load measures the longest forward (prompt and continuation, in 256-token pages), not exllamav3's 2048
    assert engine.calls[0]["max_chunk"] == 256 < engine.calls[0]["cache_tokens"]
    md = (out / "report.md").read_text()
    assert "τ exllamav3" in md and f"`{exl3}` (4.00 bpw)" in md and "recommended:" in md and "| speed |" in md
    assert "draft tokens 15 not measured: no round at 7 accepted its whole window" in md
    # the same numbers as the BF16 path on the same weights: taps, continuation, embedding and head agree
    fakes.install(monkeypatch)
    hf = run(tmp_path, pair, pair[0], out="out-hf", also_uncalibrated=True)
    for a, b in zip(report["results"], hf["results"]):
        assert a["folder"] == b["folder"] and a["kl"] == pytest.approx(b["kl"], abs=1e-6)
        assert a["top1_per_position"] == pytest.approx(b["top1_per_position"], abs=1e-6)
    assert hf["target_kind"] == "hf" and hf["bf16"]["tau"] >= 1.0 and hf["recommended_draft_tokens"] is None


def test_exl3_row_reaches_the_card(tmp_path, pair, exl3, monkeypatch):
    from toolkit.hub.card import render_card

    fakes.install(monkeypatch)
    fakes.install_engine(monkeypatch, pair[0])
    report = run(tmp_path, pair, exl3, bits="8", calibrate=False)
    card = render_card(report, bits=8.0)
    x = report["results"][0]["exl3"]
    assert f"| {x['tau']:.2f} | {x['speedup']:.2f}× | a local EXL3 quant at 4.00 bpw |" in card    # no machine path
    assert str(exl3) not in card and "huggingface.co//" not in card
    assert report["recommended_draft_tokens"] is not None


def test_exl3_target_without_cuda_is_one_line(tmp_path, pair, exl3, monkeypatch, capsys):
    fakes.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(["--recipe", str(write_recipe(tmp_path / "r.toml", pair[0])), "--model", str(pair[1]),
                              "--target", str(exl3), "--out", str(tmp_path / "out"), "--bits", "4"]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]      # after the progress bar's lines
    assert err == (f"error: --target: {exl3} is an EXL3 model, and running it needs a CUDA GPU (none found on this machine); "
                   "pass a BF16 target, or --no-calibrate --no-check")
    assert not (tmp_path / "out").exists()


def test_exl3_engine_needs_exllamav3_and_a_recent_gpu(monkeypatch):
    from toolkit.quant.engine import Exl3Engine
    from toolkit.exl3 import seams

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(seams, "version", lambda: None)
    why = Exl3Engine().unavailable("t")
    assert why.startswith("--target: t is an EXL3 model: exllamav3 is not installed")
    monkeypatch.setattr(seams, "version", lambda: "1.6.5")
    assert Exl3Engine().unavailable("t") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert Exl3Engine().unavailable("t") == ("--target: t is an EXL3 model, and exllamav3 needs compute capability 8.0 "
                                             "or newer; Tesla T4 has 7.5")


@pytest.mark.parametrize("config,msg", [
    ({"vocab_size": 256}, "vocab_size: drafter has 512, target has 256"),
    ({"num_hidden_layers": 2}, "num_target_layers: drafter was made for 3 target layers, target has 2"),
    ({"num_hidden_layers": 1}, "target_layer_ids: tap 1 (tap_shift 0) is outside the target's 1 layers")])
def test_exl3_target_that_does_not_fit_the_drafter(tmp_path, pair, config, msg, monkeypatch):
    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    bad = fakes.exl3_target(pair[0], tmp_path / "bad-exl3", **config)
    with pytest.raises(ToolkitError) as e:
        run(tmp_path, pair, bad)
    assert one_line(e) == f"--target: EXL3 target {bad} does not fit the drafter: {msg}"
    assert engine.events == [] and not (tmp_path / "out").exists()


def test_exl3_target_too_big_for_the_gpu(tmp_path, pair, exl3, monkeypatch):
    """Estimated from the folder's size before anything loads (a sparse 40 GiB file stands in for the weights)."""
    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0], free=24 * GIB)
    with open(exl3 / "model-00002-of-00002.safetensors", "wb") as f:
        f.truncate(40 * GIB)
    with pytest.raises(ToolkitError) as e:
        run(tmp_path, pair, exl3)
    msg = one_line(e)
    assert msg.startswith(f"--target: {exl3} does not fit in GPU memory: step target needs about 4")
    assert "target weights 40.0 GiB" in msg and msg.endswith("the GPU has 24.0 GiB free")
    assert engine.events == [] and not (tmp_path / "out").exists()
    engine.free = GIB // 2                       # a run whose biggest step is the converter's
    (exl3 / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ToolkitError, match=r"^this run does not fit in GPU memory: step convert needs .* the GPU has 0.5 GiB free"):
        run(tmp_path, pair, exl3)


def test_dry_run_prints_the_memory_plan(tmp_path, pair, exl3, capsys):
    assert main(["--recipe", str(write_recipe(tmp_path / "r.toml", pair[0])), "--model", str(pair[1]),
                 "--target", str(exl3), "--dry-run", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "EXL3 on exllamav3" in out and "memory plan (GPU, estimated" in out
    for s in ("target", "calibrate", "convert", "check", "speed"):
        assert f"  {s} " in out
    assert "fits a 24 GB card" in out and not (tmp_path / "o").exists()


@pytest.fixture
def hub(tmp_path, monkeypatch, pair, exl3):
    """A loopback Hub holding the drafter (main) and its EXL3 target on a 4.0bpw branch; huggingface_hub points at it."""
    from huggingface_hub import HfApi, constants

    from hubserver import HubServer
    from toolkit.hub.push import hub_endpoint

    token = "hf_quantize_exl3_k2"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_TOKEN", token)
    with HubServer(tmp_path / "hub", tokens={token: "alice"}) as server:
        api = HfApi(endpoint=server.url, token=token)
        with hub_endpoint(server.url):
            api.create_repo("alice/tiny-dflash")
            api.upload_folder(folder_path=str(pair[1]), repo_id="alice/tiny-dflash")
            api.create_repo("alice/tiny-exl3")
            api.create_branch("alice/tiny-exl3", branch="4.0bpw")
            api.upload_folder(folder_path=str(exl3), repo_id="alice/tiny-exl3", revision="4.0bpw")
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield server


def test_hub_refs_with_branches_and_their_shas(tmp_path, pair, hub, monkeypatch):
    """--model REPO@REVISION and --target REPO@BRANCH resolve to commit shas recorded in report.json; the upstream
    README lands in OUT/upstream; a bitrate branch that does not exist is one line from core.refs."""
    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    recipe = str(write_recipe(tmp_path / "r.toml", pair[0]))
    with pytest.raises(ToolkitError) as e:
        main(["--recipe", recipe, "--model", "alice/tiny-dflash@main", "--target", "alice/tiny-exl3@9.0bpw",
              "--out", str(tmp_path / "o1"), "--device", "cpu", "--bits", "8"])
    assert one_line(e) == f"--target: alice/tiny-exl3@9.0bpw: alice/tiny-exl3 has no branch, tag or commit '9.0bpw' on {hub.url}"
    assert engine.events == [] and not (tmp_path / "o1").exists()
    out = tmp_path / "o2"
    assert main(["--recipe", recipe, "--model", "alice/tiny-dflash@main", "--target", "alice/tiny-exl3@4.0bpw",
                 "--out", str(out), "--device", "cpu", "--bits", "8", "--no-calibrate"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "test/tiny-dflash" and report["revision"] == "main"
    assert report["model_sha"] == hub.repos["alice/tiny-dflash"].branches["main"]
    assert report["target"] == "alice/tiny-exl3@4.0bpw"
    assert report["target_sha"] == hub.repos["alice/tiny-exl3"].branches["4.0bpw"]
    assert report["results"][0]["exl3"]["target"] == "alice/tiny-exl3@4.0bpw"
    assert (out / "upstream" / "README.md").read_text() == (pair[1] / "README.md").read_text()
    assert "commit " + report["target_sha"] in (out / "report.md").read_text()


def test_draft_widths_and_the_recommended_one():
    assert spd.widths_for(16, []) == [3, 7, 15] and spd.widths_for(4, [3, 7, 15]) == [3]
    assert spd.widths_for(16, [1, 20]) == [1, 15]
    assert spd.best_width({3: {"speedup": 1.2}, 7: {"speedup": 1.5}, 15: {"speedup": 1.5}}) == 7   # ties: the narrower
    assert spd.best_width({3: {"speedup": 0.8}, 7: {"speedup": 0.6}}) == 3      # the best, even if < 1
    assert spd.best_width({3: {"speedup": None}}) is None


def test_recipe_draft_tokens(tmp_path):
    from toolkit.quant.recipe import load_recipe

    assert load_recipe(ROOT / "quantize" / "qwen3.6-35b-a3b-dflash.toml").draft_tokens == [3, 7, 15]
    bad = tmp_path / "r.toml"
    bad.write_text('[model]\nid = "a/b"\n[check]\ndraft_tokens = [0, 3]\n')
    with pytest.raises(ToolkitError, match=r"check.draft_tokens\[0\] must be a whole number from 1 to 1024 drafts per round, got 0"):
        load_recipe(bad)


def test_first_difference_says_where_an_output_left_ar():
    assert spd.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert spd.first_difference([1, 2, 4, 5], [1, 2, 3, 5]) == 2
    assert spd.first_difference([1, 2], [1, 2, 3]) == 2 and spd.first_difference([7], [1]) == 0


def test_report_says_where_outputs_left_ar(tmp_path, pair, exl3, monkeypatch):
    from toolkit.quant.report import render_markdown

    fakes.install(monkeypatch)
    fakes.install_engine(monkeypatch, pair[0])
    report = run(tmp_path, pair, exl3)
    assert "output left AR's" not in render_markdown(report)          # the fake engine is lossless
    report["results"][0]["exl3"]["first_diff"] = [None, 41, None, 7]
    md = render_markdown(report)
    assert f"- {report['results'][0]['folder']}: output left AR's on 2 of 4 prompts, first at token 41, 7" in md


def test_swapped_drafters_measure_as_fresh_loads(tmp_path, pair, exl3, monkeypatch):
    """speed swaps each bitrate into one load of the target: each drafter's τ, acceptance and output (against the
    one AR baseline of that load) are what a load of the target with that drafter alone measures."""
    from test_quantize_pipeline import HELD
    from toolkit.runtime.backend import encode_chat
    from toolkit.runtime.hf import load_hf_tokenizer

    fakes.install(monkeypatch)
    engine = fakes.install_engine(monkeypatch, pair[0])
    report = run(tmp_path, pair, exl3, bits="2,8", calibrate=False)
    tok = load_hf_tokenizer(exl3, "--target")
    setup = spd.SpeedSetup(exl3, str(exl3), 4.0, [encode_chat(tok, t) for t in HELD], 6, 512)
    w = report["recommended_draft_tokens"]
    for row in report["results"]:
        with spd.loaded(engine, setup, tmp_path / "out" / row["folder"]) as be:
            fresh = spd.measure(be, setup, [w], spd.baseline(be, setup))[w]
        got = row["exl3"]
        for k in ("tau", "accept_per_position", "lossless", "first_diff", "tokens", "draft_tokens"):
            assert got[k] == fresh[k], k
    # the 2 bpw drafter measures apart from the 8 bpw one: the swap took (without it both would be the BF16 drafter)
    assert report["results"][0]["exl3"]["tau"] != report["results"][1]["exl3"]["tau"]


def test_sweep_stops_after_a_window_no_round_filled(monkeypatch):
    """Greedy rounds that never accept a whole window of 3 accept the same tokens at 7 or 15: those are skipped."""
    acc = {3: [0.6, 0.2, 0.0], 7: [0.6, 0.2, 0.1, 0.0, 0, 0, 0], 15: [0.5] * 15}
    seen = []

    def measure(be, setup, widths, ar):
        seen.extend(widths)
        return {w: {"accept_per_position": acc[w], "speedup": 1.0} for w in widths}

    monkeypatch.setattr(spd, "measure", measure)
    got, skipped = spd.sweep(None, None, [15, 3, 7], None)
    assert seen == [3] and list(got) == [3] and skipped == [7, 15]
    acc[3] = [0.6, 0.2, 0.05]
    seen.clear()
    got, skipped = spd.sweep(None, None, [3, 7, 15], None)
    assert seen == [3, 7] and list(got) == [3, 7] and skipped == [15]
    acc[7][-1] = 0.01
    seen.clear()
    assert spd.sweep(None, None, [3, 7, 15], None) == ({w: {"accept_per_position": acc[w], "speedup": 1.0}
                                                       for w in (3, 7, 15)}, []) and seen == [3, 7, 15]
    # a cell whose acceptance list is shorter than its width never filled it
    assert not spd.window_filled({"accept_per_position": [1.0]}, 3) and spd.window_filled({"accept_per_position": [1, 1, .1]}, 3)
