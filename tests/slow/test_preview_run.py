"""The CPU path to a run folder: `python -m toolkit.preview_run` quantizes the tiny pair on the CPU with the stand-in
converter; the card and push --dry-run read it; a real push refuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("preview") / "run"
    r = cli("toolkit.preview_run", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "a CPU preview: not EXL3 weights" in r.stdout and "python -m toolkit.card --from" in r.stdout
    return out


def test_a_run_folder_on_the_cpu(run_dir):
    report = json.loads((run_dir / "report.json").read_text())
    assert [r["folder"] for r in report["results"]] == ["3.0bpw", "4.0bpw"]
    for r in report["results"]:
        assert r["kl"] is not None and r["top1"] is not None and r["tau"] is not None      # measured on the CPU
        cfg = json.loads((run_dir / r["folder"] / "config.json").read_text())
        assert cfg["quantization_config"]["preview"].startswith("a CPU preview")
        assert (run_dir / r["folder"] / "README.md").is_file()
    assert report["bf16"]["tau"] > 1.0                                  # the native block drafts every round
    tensors = load_file(run_dir / "4.0bpw" / "model.safetensors")
    assert any(k.endswith("norm.weight") for k in tensors)


def test_the_card_and_a_push_dry_run_read_it(run_dir):
    card = cli("toolkit.card", "--from", str(run_dir), "--repo", "me/tiny")
    assert card.returncode == 0, card.stderr and "## Measured quality" in card.stdout
    assert json.loads((run_dir / "report.json").read_text())["exllamav3_version"] is None    # no exllamav3 ran
    assert "exllamav3 version: none recorded" in card.stdout and "Requires exllamav3" not in card.stdout
    assert "the version these quants were made and measured with" not in card.stdout
    dry = cli("toolkit.push", "--repo", "me/tiny", "--from", str(run_dir), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "3.0bpw" in dry.stdout and "main" in dry.stdout


def test_a_real_push_of_a_preview_is_refused(run_dir):
    r = cli("toolkit.push", "--repo", "me/tiny", "--from", str(run_dir))
    assert r.returncode == 2 and r.stdout == ""
    assert "is a CPU preview" in r.stderr and "only with --dry-run" in r.stderr and "Traceback" not in r.stderr
