"""Bad input: numbers out of range in caches, reports and recipes, and the minor refusals a hostile user found.
Commands run in-process under core.errors.run_cli with their heavy work stubbed (fuzz_harness's STUBS): "reached"
means the checks passed and the work began, so a refusal that comes before it came before any model was loaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz_harness import cli, refused, signature, stubs, write_run  # noqa: F401  (stubs: a fixture)
from test_card import sample_report
from toolkit.core.errors import ToolkitError
from toolkit.costs.cache import cached_costs
from toolkit.costs.table import CostTable

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
BIG = 10**400                                             # valid JSON; no float holds it


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
