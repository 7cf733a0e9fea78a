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


# ---- the golden card: report + upstream folder (issue 18) ----

UPSTREAM_README = """---
license: other
license_name: dflash-research
license_link: LICENSE
base_model: Qwen/Qwen3.6-35B-A3B
pipeline_tag: text-generation
tags:
  - dflash
---

# Qwen3.6-35B-A3B-DFlash

A DFlash draft model for [Qwen/Qwen3.6-35B-A3B](https://huggingface.co/Qwen/Qwen3.6-35B-A3B).
See [the paper](https://arxiv.org/abs/2602.00000) and ![architecture](assets/dflash.png).

## Benchmark Results

| concurrency | speedup |
|---|---|
| 1 | 3.61x |
"""


def golden_report() -> dict:
    """sample_report plus what issue 17 adds: exllamav3 τ/speedup with a named target on some rows, a draft length."""
    report = sample_report(3)
    report["results"][0]["exl3"] = {"tau": 5.123, "speedup": 2.345, "target": "alice/Qwen3.6-35B-A3B-exl3@4.0bpw",
                                    "target_bits": 4.0}
    report["results"][2]["exl3"] = {"tau": 4.5, "speedup": None, "target": "alice/Qwen3.6-35B-A3B-exl3@4.0bpw",
                                    "target_bits": 4.0}
    report["bf16"]["exl3"] = {"tau": 5.5, "speedup": 2.5, "target": "alice/Qwen3.6-35B-A3B-exl3@4.0bpw",
                              "target_bits": 4.0}
    report["recommended_draft_tokens"] = 7
    return report


def write_upstream(folder, readme: str | None = UPSTREAM_README) -> None:
    folder.mkdir(parents=True)
    if readme is not None:
        (folder / "README.md").write_text(readme)
    (folder / "LICENSE").write_text("DFlash research license\n")


def yaml_blocks(text: str) -> list[dict]:
    import yaml

    return [yaml.safe_load(b.split("```", 1)[0]) for b in text.split("```yaml\n")[1:]]


def section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    nxt = text.find("\n## ", start + len(heading))
    return text[start:] if heading == "## Original model card" or nxt < 0 else text[start:nxt]


@pytest.mark.parametrize("bits", [None, 3.0], ids=["main", "3.0bpw"])
def test_golden_card_every_part(tmp_path, bits):
    report = golden_report()
    write_upstream(tmp_path / "upstream")
    text = render_card(report, repo="alice/drafter-exl3", bits=bits, upstream=tmp_path / "upstream")
    (tmp_path / "README.md").write_text(text)
    card = ModelCard.load(tmp_path / "README.md")
    body, rev, model = card.text, report["revision"], report["model"]

    # metadata: the drafter quantized, the upstream license copied (its relative link made absolute), exllamav3
    data = card.data.to_dict()
    assert data["base_model"] == model and data["base_model_relation"] == "quantized"
    assert data["license"] == "other" and data["license_name"] == "dflash-research"
    assert data["license_link"] == f"https://huggingface.co/{model}/blob/{rev}/LICENSE"
    assert data["library_name"] == "exllamav3" and data["pipeline_tag"] == "text-generation"
    assert {"exl3", "dflash", "speculative-decoding"} <= set(data["tags"])

    # framing, with the names filled in
    framing = section(body, "## What this is, and what it is not")
    assert "**Not a standalone model.**" in framing and f"DFlash draft model for [{report['target']}]" in framing
    assert "**Not the BF16 checkpoint.**" in framing and "EXL3" in framing and "TabbyAPI" in framing
    assert f"use [{model}](https://huggingface.co/{model}) instead" in framing
    assert "**No fine-tuning.**" in framing and "**Quantization changes numbers.**" in framing
    assert "upstream model card is reproduced" in framing
    assert "**Requires exllamav3 >= 1.6.5**" in body

    # the table: torch τ as before, plus τ and speedup on exllamav3 with the named target and its bitrate
    rows = parse_table(section(body, "## Measured quality"))
    shown = [r for r in report["results"] if bits is None or r["bits"] == bits]
    assert len(rows) == len(shown) + 1
    for row, r in zip(rows, shown + [report["bf16"]]):
        m = r.get("exl3")
        check_cell(row["τ on exllamav3"], m and m["tau"], abs_tol=0.005)
        speed = m and m["speedup"]
        assert row["Speedup on exllamav3"] == (NOT_MEASURED if speed is None else f"{speed:.2f}×")
        assert row["exllamav3 target"] == (NOT_MEASURED if not m else "alice/Qwen3.6-35B-A3B-exl3@4.0bpw (4.00 bpw)")
        if r is not report["bf16"]:
            assert row["Calibrated"] == ("yes" if r["calibrated"] else "no")
            check_cell(row["KL vs bf16"], r["kl"], rel_tol=5e-4)
            check_cell(row["Top-1 agreement"], r["top1"], scale=100, abs_tol=0.05)
            check_cell(row["τ (tokens/round)"], r["tau"], abs_tol=0.005)
    assert ("2.35×" in body) == (bits is None) and "not measured" in rows[0 if bits else 2]["Speedup on exllamav3"]

    # how to run: exllamav3 with the recommended draft length, TabbyAPI's config keys, the toolkit
    run = section(body, "## How to run")
    branch = "3.0bpw" if bits else "4.0bpw"
    local = f"Qwen3.6-35B-A3B-DFlash-exl3-{branch}"
    assert f"hf download alice/drafter-exl3 --revision {branch} --local-dir {local}" in run
    assert "draft_model=draft, draft_cache=draft_cache, num_draft_tokens=7)" in run
    (tabby,) = yaml_blocks(run)
    assert tabby == {"model": {"model_dir": "models", "model_name": "TARGET"},
                     "draft_model": {"draft_model_dir": "models", "draft_model_name": local, "draft_num_tokens": 7}}
    assert f"python app.py --backend exllamav3 --target TARGET --draft {local}" in run
    assert f"python -m toolkit.generate --backend exllamav3 --target TARGET --draft {local}" in run

    # license named, with the upstream LICENSE file linked
    lic = section(body, "## License")
    assert "**other (dflash-research)**" in lic and f"[LICENSE](https://huggingface.co/{model}/blob/{rev}/LICENSE)" in lic

    # the original card: verbatim below its heading, its front matter gone, its links kept
    original = section(body, "## Original model card")
    upstream_body = UPSTREAM_README.split("---\n", 2)[2].lstrip("\n")
    assert original.rstrip().endswith(upstream_body.rstrip())
    assert "license_name: dflash-research" not in body       # the upstream front matter is not in the body
    assert "[the paper](https://arxiv.org/abs/2602.00000)" in original and "(assets/dflash.png)" in original
    assert f"[{model}](https://huggingface.co/{model}/tree/{rev})" in original
    assert body.index("## Original model card") > body.index("## License") > body.index("## How to run")


def test_card_without_upstream_readme_says_so(tmp_path):
    report = golden_report()
    del report["exllamav3_version"], report["recommended_draft_tokens"]
    report["revision"] = None
    write_upstream(tmp_path / "up", readme=None)
    text = render_card(report, repo="alice/x", upstream=tmp_path / "up")
    card = ModelCard(text)
    assert "license" not in card.data.to_dict()          # no upstream metadata: no license invented
    original = section(card.text, "## Original model card")
    assert "holds no README.md" in original and f"(https://huggingface.co/{report['model']})" in original
    assert "upstream model card is reproduced" not in card.text
    assert "names no license" in card.text and f"[LICENSE](https://huggingface.co/{report['model']}/blob/main/LICENSE)" in card.text
    assert "**exllamav3 version: none recorded.**" in card.text and "Requires exllamav3" not in card.text
    (tabby,) = yaml_blocks(card.text)
    assert "draft_num_tokens" not in tabby["draft_model"] and "num_draft_tokens" not in card.text
    assert "recommends no draft length" in card.text
    assert render_card(report, repo="alice/x") == render_card(report, repo="alice/x", upstream=tmp_path / "missing")


def test_upstream_license_variants(tmp_path):
    from toolkit.hub.upstream import license_fields, read_upstream

    for meta, want in [("license: apache-2.0\n", {"license": "apache-2.0"}),
                       ("license: other\nlicense_link: https://example.org/terms\n",
                        {"license": "other", "license_link": "https://example.org/terms"}),
                       ("license: [mit]\n", {"license": "mit"}), ("tags: [x]\n", {}), (": : bad yaml [\n", {})]:
        folder = tmp_path / str(abs(hash(meta)))
        write_upstream(folder, readme=f"---\n{meta}---\n# Card\n")
        up = read_upstream(folder)
        assert license_fields(up, "z/m", "abc") == want, meta
        assert up.readme == "# Card\n" and up.licenses == ["LICENSE"]
    assert read_upstream(None).readme is None and read_upstream(tmp_path / "none").licenses == []


def test_copy_upstream_takes_readme_and_licenses_only(tmp_path):
    from toolkit.hub.upstream import copy_upstream

    model = tmp_path / "model"
    model.mkdir()
    for name in ("README.md", "LICENSE", "LICENSE-MODEL.txt", "config.json", "model.safetensors", "readme.txt"):
        (model / name).write_text(name)
    out = tmp_path / "out"
    dest = copy_upstream(model, out)
    assert dest == out / "upstream"
    assert sorted(p.name for p in dest.iterdir()) == ["LICENSE", "LICENSE-MODEL.txt", "README.md"]
    assert (dest / "README.md").read_text() == "README.md"
    (model / "LICENSE-MODEL.txt").unlink()                # a new revision without that file: the copy follows it
    copy_upstream(model, out)
    assert sorted(p.name for p in dest.iterdir()) == ["LICENSE", "README.md"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    with pytest.raises(ToolkitError, match="not a folder"):
        copy_upstream(tmp_path / "nope", out)


def write_run(out) -> dict:
    """A quantize OUT for the card command: report.json, the bitrate folders, the plot and upstream/."""
    import json

    report = golden_report()
    out.mkdir()
    for r in report["results"]:
        (out / r["folder"]).mkdir()
        (out / r["folder"] / "config.json").write_text("{}")
        (out / r["folder"] / "README.md").write_text("# card\n")      # a finished run: its cards are written
    (out / "report.json").write_text(json.dumps(report))
    (out / "tau_top1.png").write_bytes(b"png")
    write_upstream(out / "upstream")
    return report


def test_card_command_prints_what_push_uploads(tmp_path, capsys):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from toolkit.card import main

    out = tmp_path / "run"
    report = write_run(out)
    shutil.rmtree(out / "3.0bpw")                         # push skips a missing folder; so does the card
    branches = {"4.0bpw": "4.0bpw"}
    text = main(["--from", str(out), "--repo", "alice/drafter-exl3"])
    assert capsys.readouterr().out == text == render_card(report, "alice/drafter-exl3", branches=branches,
                                                          image="tau_top1.png", upstream=out / "upstream")
    assert "3.0bpw (not uploaded)" in text and "![τ and top-1" in text and "## Original model card" in text
    per_bits = main(["--from", str(out), "--bits", "4"])
    assert per_bits == render_card(report, bits=4.0, branches=branches, upstream=out / "upstream")
    assert "USER/REPO" in per_bits and "![τ" not in per_bits
    root = Path(__file__).resolve().parents[1]
    for args, msg in [(["--from", str(tmp_path)], "no report.json"), (["--from", str(out), "--repo", "../.."],
                      "--repo must be USER/NAME"), (["--from", str(out), "--bits", "5"], "bits=5.0 is not in report")]:
        proc = subprocess.run([sys.executable, "-m", "toolkit.card", *args], cwd=root, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and msg in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_push_dry_run_points_to_the_card_command(tmp_path, capsys, monkeypatch):
    from toolkit.hub.push import PushOptions, push

    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "run"
    write_run(out)
    push(PushOptions("alice/drafter-exl3", str(out), dry_run=True))
    assert f"python -m toolkit.card --from {out} --repo alice/drafter-exl3" in capsys.readouterr().out
