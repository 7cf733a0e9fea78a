"""Cards and the published report name models, never paths of the machine that made them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_card import sample_report
from toolkit.hub.card import run_card
from toolkit.hub.names import link, public_report, served_model
from toolkit.hub.push import plan

LOCAL = "/home/alice/models/Qwen3.6-35B-A3B-exl3-4.0bpw"


def local_target_report(**extra) -> dict:
    """A run measured on a local EXL3 target folder, as most single-GPU users run it."""
    report = sample_report(0)
    m = {"tau": 3.1, "speedup": 1.8, "target": LOCAL, "target_bits": 4.0, "draft_tokens": 7, "tok_s": 90.0,
         "ar_tok_s": 50.0, "accept_per_position": [0.5], "lossless": 1.0, "first_diff": [None]}
    report.update(target=LOCAL, target_kind="exl3", target_sha=None, **extra)
    report["bf16"]["exl3"] = dict(m)
    for r in report["results"]:
        r["exl3"] = dict(m)
    return report


def write_run(out: Path, report: dict, upstream_meta: str = "") -> Path:
    out.mkdir(parents=True)
    for r in report["results"]:
        (out / r["folder"]).mkdir()
        (out / r["folder"] / "README.md").write_text("card")
    (out / "report.json").write_text(json.dumps(report))
    (out / "report.md").write_text(f"# report\n- target: `{LOCAL}`\nwith the EXL3 target `{LOCAL}` (4.00 bpw)\n")
    (out / "tau_top1.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    if upstream_meta:
        (out / "upstream").mkdir()
        (out / "upstream" / "README.md").write_text(f"---\n{upstream_meta}\n---\n\n# DFlash\n")
    return out


@pytest.mark.parametrize("how", ["recorded", "upstream card", "older report"])
def test_card_of_a_local_target_names_the_hub_model_and_no_path(tmp_path, how):
    extra = {"recorded": {"target_model": "Qwen/Qwen3.6-35B-A3B", "target_local": True}}.get(how, {})
    meta = "base_model: Qwen/Qwen3.6-35B-A3B" if how == "upstream card" else ""
    out = write_run(tmp_path / "out", local_target_report(**extra), meta)
    for bits in (None, 4.0):
        card = run_card(out, "alice/drafter-exl3", bits)
        assert "/home/alice" not in card and "huggingface.co//" not in card and LOCAL not in card
        assert "a local EXL3 quant at 4.00 bpw" in card
        if how != "older report":                       # nothing in an older report names the served model
            assert "for [Qwen/Qwen3.6-35B-A3B](https://huggingface.co/Qwen/Qwen3.6-35B-A3B)" in card
        else:
            assert "DFlash draft model for its target model" in card
    for target in [t for t in card.split("](")[1:]]:
        assert target.startswith("https://huggingface.co/") and not target.startswith("https://huggingface.co//")


def test_hub_target_is_named_by_its_ref_and_linked_to_its_branch():
    report = local_target_report(target_model="Qwen/Qwen3.6-35B-A3B", target_local=False)
    report["target"] = "alice/Qwen3.6-35B-A3B-exl3@4.0bpw"
    for m in [report["bf16"]["exl3"], *(r["exl3"] for r in report["results"])]:
        m["target"] = report["target"]
    pub = public_report(report)
    assert pub["target"] == "Qwen/Qwen3.6-35B-A3B" and pub["bf16"]["exl3"]["target"] == "alice/Qwen3.6-35B-A3B-exl3@4.0bpw"
    assert link("alice/x@4.0bpw") == "[alice/x@4.0bpw](https://huggingface.co/alice/x/tree/4.0bpw)"
    assert link("/home/alice/x") == "`/home/alice/x`" and link("./x", "bf16 original") == "bf16 original"
    assert served_model({"model": "m/x", "target": "Qwen/Qwen3-8B", "target_kind": "hf"}) == "Qwen/Qwen3-8B"
    assert served_model({"model": "m/x", "target": "models/qwen", "target_kind": "hf", "target_local": True}) is None


def test_pushed_report_has_no_path(tmp_path):
    report = local_target_report(target_model="Qwen/Qwen3.6-35B-A3B", target_local=True)
    out = write_run(tmp_path / "out", report)
    uploads = plan(report, out, "{bits:.1f}bpw", "alice/drafter-exl3", tmp_path / "stage")
    main = next(u for u in uploads if u.branch == "main")
    for name in ("report.json", "report.md", "README.md"):
        text = (main.folder / name).read_text()
        assert "/home/alice" not in text and "huggingface.co//" not in text, name
    pub = json.loads((main.folder / "report.json").read_text())
    assert pub["target"] == "a local EXL3 quant at 4.00 bpw" and pub["results"][0]["exl3"]["target_bits"] == 4.0
    assert LOCAL in (out / "report.json").read_text()                  # the run's own report keeps what was given


def test_quantize_records_the_served_model(tmp_path):
    from toolkit.quant.recipe import merge

    recipe = Path(__file__).resolve().parents[1] / "quantize" / "qwen3.6-35b-a3b-dflash.toml"
    s = merge(str(recipe), None, None, str(tmp_path), None, str(tmp_path / "o"), None)
    assert s.target_model == "Qwen/Qwen3.6-35B-A3B" and s.target_local and not s.model_local
    assert merge(str(recipe), None, None, None, None, None, None, "me/Other").target_model == "me/Other"
    with pytest.raises(Exception, match="--target-model must be the Hub id"):
        merge(str(recipe), None, None, None, None, None, None, "/home/alice/q")
