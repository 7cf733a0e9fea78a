"""The generate CLI's JSON contract and its one-line errors, run as a user would run it."""

import json
import re
import subprocess
import sys

import pytest

from toolkit.generate import GenerateOptions, generate


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "toolkit.generate", *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_json_contract_on_built_fixtures(tmp_path):
    out = subprocess.run([sys.executable, "-m", "toolkit.fixtures", "--out", str(tmp_path), "--arch", "llama"],
                         capture_output=True, text=True, check=True).stdout
    paths = json.loads(out.splitlines()[-1])
    r = cli("--target", paths["target"], "--draft", paths["draft"], "--prompt", "hi", "--compare-ar", "--json",
            "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["lossless"] is True and res["tokens"] == res["ar_tokens"] and len(res["tokens"]) == 16
    for key in ("tokens", "text", "rounds", "tau", "tok_s", "ar_tokens", "ar_tok_s", "speedup", "lossless"):
        assert key in res
    assert set(res["rounds"][1]) >= {"drafted", "accepted", "bonus", "t_draft_ms", "t_verify_ms"}
    assert sum(rd["accepted"] + 1 for rd in res["rounds"]) == len(res["tokens"])
    assert 1.0 <= res["tau"] <= 16


def test_embedded_default_runs_the_trained_pair(capsys):
    res = generate(GenerateOptions(prompt="Return the list of", max_new_tokens=48, compare_ar=True, json_out=True, raw=True,
                                   block_size=16))
    assert res["lossless"] and res["tau"] > 1.0
    assert json.loads(capsys.readouterr().out)["tokens"] == res["tokens"]


@pytest.mark.parametrize("args, needle", [
    (["--prompt", "  "], "--prompt is empty"),
    (["--prompt", "hi", "--target", "/nonexistent/model"], "--target: /nonexistent/model is not a folder"),
    (["--prompt", "hi", "--draft", "/tmp"], "--draft needs --target"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--block-size", "1"], "block_size must be >= 2"),
    (["--prompt", "hi", "--block-size", "fast"], "block_size must be auto or an integer >= 2, got 'fast'"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and needle in r.stderr


def test_mismatched_drafter_is_refused(tmp_path, pair):
    big = tmp_path / "big"
    from toolkit.assets.fixtures import build
    t, _ = build(big, arch="llama", hidden=64)
    r = cli("--target", str(t), "--draft", str(pair[1]), "--prompt", "hi")
    assert r.returncode == 2 and "hidden_size: drafter has 128, target has 64" in r.stderr


def test_block_size_auto_is_the_default_and_reports_its_widths(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_COST_CACHE", str(tmp_path))
    res = generate(GenerateOptions(prompt="Return the list of", max_new_tokens=32, compare_ar=True, raw=True))
    assert res["block_size"] == "auto" and res["lossless"] and res["tokens"] == res["ar_tokens"]
    steps = [r for r in res["rounds"] if not r["prefill"]]
    assert all(r["proposed"] in (0, 15) and len(r["drafted"]) <= r["proposed"] for r in steps)
    assert all((r["proposed"] == 0) == (r["drafted"] == []) for r in steps)
    assert sum(r["accepted"] + 1 for r in res["rounds"]) == len(res["tokens"])
    err = capsys.readouterr().err
    assert f"of {len(steps)} (block auto; the rest plain AR)" in err
    fixed = generate(GenerateOptions(prompt="Return the list of", max_new_tokens=32, raw=True, block_size="8"))
    assert fixed["block_size"] == 8 and fixed["tokens"] == res["tokens"]
    assert all(len(r["drafted"]) == r["proposed"] == 7 for r in fixed["rounds"][1:])


def test_a_run_decoded_as_plain_ar_says_why_in_one_sentence(capsys, pair, monkeypatch):
    from toolkit import generate as gen
    from toolkit.dflash import load_drafter
    from toolkit.costs.table import CostTable
    from toolkit.runtime.hf import load_hf_model, load_hf_tokenizer
    from toolkit.runtime.torch_backend import TorchBackend

    losing = CostTable({1: {0: 10.0, **{w: 20.0 + 11 * w for w in range(1, 16)}}})    # no acceptance pays for a draft
    be = TorchBackend(load_hf_model(pair[0]), load_hf_tokenizer(pair[0]), load_drafter(pair[1]), costs=losing)
    monkeypatch.setattr(gen, "load", lambda *a, **k: be)
    res = generate(GenerateOptions(prompt="Return the list of", max_new_tokens=24, raw=True))
    steps = [r for r in res["rounds"] if not r["prefill"]]
    assert not any(r["drafted"] for r in steps)                 # the first probe would come much later
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"[torch] Drafting does not pay here: the policy decoded {len(steps)} of {len(steps)} rounds as "
                       "plain AR, as its measured round costs and the drafter's acceptance advise.")
    generate(GenerateOptions(prompt="Return the list of", max_new_tokens=24, raw=True, block_size="8"))
    assert "Drafting does not pay" not in capsys.readouterr().err      # a fixed block says nothing of the kind


def test_all_plain_ar_reports_no_ratio(monkeypatch, capsys):
    """A speculative run that never drafted has no speedup: null with the reason in the JSON, said in the text."""
    import toolkit.generate as gen
    from app_fakes import FakeBackend

    monkeypatch.setattr(gen, "load", lambda *a, **k: FakeBackend(block_size=1, answer_len=12))
    res = gen.generate(gen.GenerateOptions(prompt="hi", compare_ar=True, json_out=True, reps=2))
    assert res["speedup"] is None and "plain AR" in res["speedup_reason"] and res["speedup_spread"] is None
    assert res["lossless"] is True and len(res["tok_s_reps"]) == len(res["ar_tok_s_reps"]) == 2
    assert json.loads(capsys.readouterr().out)["speedup"] is None
    gen.generate(gen.GenerateOptions(prompt="hi", compare_ar=True, reps=1))
    err = capsys.readouterr().err
    assert "speedup none (every round was plain AR" in err and "x," not in err.split("speedup")[1]


def test_drafting_run_reports_the_median_ratio_and_its_spread(monkeypatch, capsys):
    import toolkit.generate as gen
    from app_fakes import FakeBackend

    monkeypatch.setattr(gen, "load", lambda *a, **k: FakeBackend(answer_len=40))
    res = gen.generate(gen.GenerateOptions(prompt="hi", compare_ar=True, block_size=16, reps=3))
    sp = res["speedup_spread"]
    assert res["speedup_reason"] is None and sp["n"] == 3 and sp["min"] <= res["speedup"] <= sp["max"]
    ratios = sorted(s / a for s, a in zip(res["tok_s_reps"], res["ar_tok_s_reps"]))
    assert res["speedup"] == pytest.approx(ratios[1])                  # the median of the paired ratios
    assert res["tok_s"] / res["ar_tok_s"] == pytest.approx(res["speedup"])   # the rates beside it are that pair's
    err = capsys.readouterr().err
    assert "the median of 3 lockstep pairs" in err and res["lockstep"]       # the torch backend on a CPU
    shown = [float(x) for x in re.findall(r"([\d.]+) tok/s", err)]
    assert shown[0] / shown[1] == pytest.approx(res["speedup"], rel=0.02) and "of repetition" in err
    from toolkit.runtime.backend import Capabilities

    gpu_be = FakeBackend(answer_len=40)
    gpu_be.caps = Capabilities(batching=True, gpu_only=True)                  # an engine that runs on a GPU only
    monkeypatch.setattr(gen, "load", lambda *a, **k: gpu_be)
    gpu = gen.generate(gen.GenerateOptions(prompt="hi", compare_ar=True, block_size=16, reps=2, backend="exllamav3"))
    assert gpu["lockstep"] is False and "the median of 2 alternating pairs" in capsys.readouterr().err
    monkeypatch.setattr(gen, "load", lambda *a, **k: FakeBackend(answer_len=40))
    one = gen.generate(gen.GenerateOptions(prompt="hi", compare_ar=True, block_size=16, reps=1))
    assert one["speedup_spread"] is None and "no spread measured" in capsys.readouterr().err
    with pytest.raises(gen.ToolkitError, match="reps"):
        from toolkit.core.cli import run as run_cli
        run_cli(lambda **kw: gen.generate(gen.GenerateOptions(**kw)), gen.GenerateOptions,
                ["--prompt", "hi", "--reps", "0"], "g")
