"""The benchmark CLI and function on the torch backend with the tiny trained pair (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.bench import bench, job_list, main, run_jobs
from toolkit.assets.prompts import BUILTIN, load_prompts
from toolkit.core.errors import ToolkitError
from toolkit.runtime.backend import Backend, GenSettings
from toolkit.runtime.events import Round, tokens_of


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    r = bench(backend="torch", block_sizes=[4, 64], concurrency=[1, 2], max_new_tokens=10, limit=3,
              out=str(out), warmup=False, quiet=True)
    return r, out


def test_bench_grid_json_and_plot(result):
    r, out = result
    assert json.loads((out / "bench.json").read_text()) == json.loads(json.dumps(r))
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["out"]             # no temp folder left behind
    assert r["block_sizes"] == [4, 16]                                   # 64 is cut to the drafter's 16
    assert [(c["block_size"], c["concurrency"]) for c in r["cells"]] == [(b, c) for b in (4, 16) for c in (1, 2)]
    assert r["categories"] == ["chat", "code", "math"] and r["num_prompts"] == 3
    ar = {a["concurrency"]: a for a in r["ar"]}
    for c in r["cells"]:
        assert c["lossless"] == 1.0                                      # greedy: the target's own tokens
        assert len(c["accept_per_position"]) == c["block_size"] - 1
        assert c["speedup"] == pytest.approx(c["tok_s"] / ar[c["concurrency"]]["tok_s"])
        assert c["tau"] >= 1.0 and c["tokens"] == ar[c["concurrency"]]["tokens"] and c["jobs"] == {1: 3, 2: 4}[c["concurrency"]]


def test_best_per_concurrency_picks_the_fastest_or_ar(result):
    from toolkit.bench import best_per_concurrency

    r, _ = result
    assert [b["concurrency"] for b in r["best"]] == [1, 2]
    for b in r["best"]:
        spec = [c for c in r["cells"] if c["concurrency"] == b["concurrency"]]
        top = max(spec, key=lambda c: c["tok_s"])
        if b["block_size"] is None:
            assert top["speedup"] <= 1.0 and b["speedup"] == 1.0
        else:
            assert b["block_size"] == top["block_size"] and b["speedup"] == top["speedup"] > 1.0
    ar = [{"concurrency": 1, "tok_s": 50.0}, {"concurrency": 8, "tok_s": 500.0}]
    cells = [{"concurrency": 1, "block_size": 8, "tok_s": 100.0, "speedup": 2.0},
             {"concurrency": 1, "block_size": 16, "tok_s": 80.0, "speedup": 1.6},
             {"concurrency": 8, "block_size": 8, "tok_s": 400.0, "speedup": 0.8}]
    assert best_per_concurrency(ar, cells) == [{"concurrency": 1, "block_size": 8, "speedup": 2.0},
                                               {"concurrency": 8, "block_size": None, "speedup": 1.0}]


def test_cli_prints_the_table(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Return the number of items", "category": "doc"}\n\nSplit the string at sep\n')
    main(["--prompts", str(prompts), "--block-sizes", "8", "--concurrency", "1", "--max-new-tokens", "8",
          "--out", str(tmp_path / "o"), "--raw", "--no-warmup"])
    out = capsys.readouterr().out
    assert "speedup" in out and "  8     1" in out and "fastest measured per concurrency: c=1: " in out
    r = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert r["categories"] == ["doc", "file"] and r["raw"] is True


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "toolkit.bench", "--concurrency", "0", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --concurrency must be integers >= 1, got [0]"
    assert not (tmp_path / "x").exists()


def test_prompt_files(tmp_path):
    assert len(BUILTIN) >= 20 and {p.category for p in BUILTIN} == {"chat", "code", "math"}
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(ToolkitError, match=r"line 2 has no \"prompt\" string"):
        load_prompts(f)
    f.write_text("\n\n")
    with pytest.raises(ToolkitError, match="has no prompts"):
        load_prompts(f)
    with pytest.raises(ToolkitError, match="is not a file"):
        load_prompts(tmp_path / "missing")


def test_job_list_fills_whole_waves():
    ids = [[1], [2], [3]]
    assert job_list(ids, 1) == ids
    assert job_list(ids, 2) == [[1], [2], [3], [1]]
    assert len(job_list(ids, 32)) == 32


class Sequential(Backend):
    """A backend that does not batch: the base class runs its jobs one after another."""

    name, block_size, max_context, eos_ids, tokenizer = "fake", 4, 100, (), None

    def generate(self, ids, settings, speculative=True):
        yield Round((), 0, ids[0], prefill=True)
        yield Round((9, 9, 9) if speculative else (), 0, ids[0] + 1)


class Batched(Sequential):
    def generate_many(self, prompts, settings, speculative=True):
        for i in reversed(range(len(prompts))):            # rounds of jobs arrive interleaved
            for r in self.generate(prompts[i], settings, speculative):
                yield i, r


@pytest.mark.parametrize("backend", [Sequential(), Batched()])
def test_run_jobs_with_and_without_generate_many(backend):
    rounds, secs = run_jobs(backend, [[1], [5]], GenSettings(), True)
    assert [tokens_of(r) for r in rounds] == [[1, 2], [5, 6]] and secs >= 0


def test_factory_errors(tmp_path):
    from toolkit.runtime.factory import load_backend

    with pytest.raises(ToolkitError, match="backend must be one of torch, exllamav3, got 'vllm'"):
        load_backend("vllm", tmp_path)
    with pytest.raises(ToolkitError, match="draft: .*missing is not a folder"):
        load_backend("torch", tmp_path, tmp_path / "missing")
