"""The model card: metadata and the measured table parsed back with ModelCard.load and checked against the report."""

from __future__ import annotations

import random

import pytest
from huggingface_hub import ModelCard

from toolkit.hub.card import NOT_MEASURED, render_card
from toolkit.core.errors import ToolkitError


def sample_report(seed: int = 0, bits=(4.0, 3.0), uncalibrated=(4.0,), measured: bool = True) -> dict:
    """A schema-1 report like the quantize pipeline writes: random plausible numbers, some nulls."""
    rng = random.Random(seed)
    rows = []
    for b in bits:
        for cal in [True] + ([False] if b in uncalibrated else []):
            folder = f"{b:.1f}bpw" + ("" if cal else "-uncal")
            m = measured and not (b == bits[-1] and cal)  # the last calibrated row: nothing measured
            pos = [rng.random() for _ in range(4)]
            rows.append({
                "bits": b, "branch": folder, "folder": folder, "size_bytes": int(b * 1000 + rng.randrange(1000)),
                "calibrated": cal, "kl": rng.uniform(1e-3, 0.1) if m else None, "kl_per_position": pos if m else None,
                "top1": rng.uniform(0.8, 1.0) if m else None, "top1_per_position": pos if m else None,
                "tau": rng.uniform(2, 8) if m and cal else None, "passed": (rng.random() > 0.3) if m else None,
            })
    return {"schema": 1, "model": "z-lab/Qwen3.6-35B-A3B-DFlash", "revision": "0123abcd" * 5,
            "target": "Qwen/Qwen3.6-35B-A3B", "created": "2025-12-02", "toolkit_version": "0.1.0",
            "exllamav3_version": "1.6.5", "block_size": 16, "tap_shift": 1, "device": None,
            "bf16": {"tau": rng.uniform(5, 8), "size_bytes": 16 * 1000}, "results": rows}


def parse_table(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def check_cell(cell: str, value, scale: float = 1.0, abs_tol: float = 0.0, rel_tol: float = 0.0) -> None:
    """`cell` shows `value` (times scale) to its printed precision, or "not measured" for a null."""
    if value is None:
        assert cell == NOT_MEASURED
    else:
        want = value * scale
        assert abs(float(cell.rstrip("%")) - want) <= abs_tol + rel_tol * abs(want) + 1e-12, (cell, value)


@pytest.mark.parametrize("seed", [0, 1])
def test_main_card_matches_report(tmp_path, seed):
    report = sample_report(seed)
    (tmp_path / "README.md").write_text(render_card(report, repo="alice/drafter-exl3"))
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == report["model"]
    assert data["base_model_relation"] == "quantized"
    assert data["library_name"] == "exllamav3"
    assert data["pipeline_tag"] == "text-generation"
    assert {"exl3", "dflash", "speculative-decoding"} <= set(data["tags"])

    rows = parse_table(card.text)
    assert len(rows) == len(report["results"]) + 1  # every result, uploaded or not, then bf16
    for row, r in zip(rows, report["results"]):
        assert r["folder"] in row["Branch"]
        assert ("not uploaded" in row["Branch"]) == (not r["calibrated"] and r["bits"] in (4.0,))
        assert float(row["Bits"]) == r["bits"]
        assert row["Calibrated"] == ("yes" if r["calibrated"] else "no")
        check_cell(row["KL vs bf16"], r["kl"], rel_tol=5e-4)
        check_cell(row["Top-1 agreement"], r["top1"], scale=100, abs_tol=0.05)
        check_cell(row["τ (tokens/round)"], r["tau"], abs_tol=0.005)
        assert row["Validation"] == (NOT_MEASURED if r["passed"] is None else ("pass" if r["passed"] else "FAIL"))
    check_cell(rows[-1]["τ (tokens/round)"], report["bf16"]["tau"], abs_tol=0.005)
    for branch in ("4.0bpw", "3.0bpw"):
        assert f"hf download alice/drafter-exl3 --revision {branch}" in card.text
        assert f"https://huggingface.co/alice/drafter-exl3/tree/{branch}" in card.text
    assert "--revision 4.0bpw-uncal" not in card.text
    assert "exllamav3" in card.text and "toolkit.generate" in card.text


def test_unmeasured_report_invents_nothing():
    report = sample_report(measured=False)
    report["bf16"]["tau"] = None
    text = render_card(report, repo="alice/x")
    rows = parse_table(text)
    for row in rows[:-1]:
        assert row["KL vs bf16"] == row["Top-1 agreement"] == row["τ (tokens/round)"] == NOT_MEASURED
    assert rows[-1]["τ (tokens/round)"] == NOT_MEASURED
    assert "τ is the mean number of tokens accepted" in text and "not measured in this run" in text


def test_per_bitrate_card(tmp_path):
    report = sample_report(2)
    (tmp_path / "README.md").write_text(render_card(report, repo="alice/x", bits=3.0))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == report["model"]
    rows = parse_table(card.text)
    assert [r["Bits"] for r in rows] == ["3.00", "16.00"]
    assert "--revision 3.0bpw" in card.text and "--revision 4.0bpw" not in card.text
    assert "3.0 bpw" in card.text.strip().splitlines()[0]
    no_repo = render_card(report, bits=4.0)  # what the quantize pipeline writes before a repo is known
    assert "USER/REPO" in no_repo and "4.0bpw-uncal" in no_repo


def test_bad_reports_raise_one_line():
    with pytest.raises(ToolkitError, match="schema must be 1"):
        render_card({**sample_report(), "schema": 2})
    bad = sample_report()
    del bad["results"][0]["size_bytes"]
    with pytest.raises(ToolkitError, match=r"results\[0\] lacks size_bytes"):
        render_card(bad)
    with pytest.raises(ToolkitError, match="bits=5.0 is not in report"):
        render_card(sample_report(), bits=5.0)
