"""The card's words follow the run: which prompts KL and top-1 use, why the τ column is empty, a local drafter named
and never linked."""

from __future__ import annotations

import re

from test_card import sample_report

from toolkit.hub.card import render_card


def unmeasured(**changes) -> dict:
    report = sample_report(measured=False)
    report["bf16"]["tau"] = None
    report.update(changes)
    return report


def test_kl_and_top1_name_the_held_out_prompts():
    text = render_card(sample_report(), repo="alice/x")
    assert "over the block positions of the held-out check prompts" in text
    assert "calibration prompts" not in text


def test_an_exl3_target_explains_the_empty_tau_column():
    text = render_card(unmeasured(target="alice/Qwen3.6-35B-A3B-exl3@4.0bpw", target_kind="exl3"), repo="alice/x")
    assert "this run's target was an EXL3 quant" in text and "BF16 (transformers) target" in text
    assert "needs a GPU" not in text


def test_no_target_and_a_skipped_check_say_so():
    assert "it had no target to decode with" in render_card(unmeasured(target=None), repo="alice/x")
    assert "its check was skipped" in render_card(unmeasured(target_kind="hf"), repo="alice/x")
    measured = render_card({**sample_report(), "device": "NVIDIA H100 80GB HBM3"}, repo="alice/x")
    assert "through this toolkit's torch runtime with the BF16 target, measured on NVIDIA H100 80GB HBM3" in measured


def test_a_local_drafter_is_named_never_linked():
    report = {**sample_report(), "model": "toolkit/data/smollm2_dflash", "model_local": True, "revision": None}
    text = render_card(report, repo="alice/x")
    assert "smollm2_dflash" in text
    assert not re.search(r"huggingface\.co/(toolkit|smollm2_dflash)", text)
    assert "the local drafter `smollm2_dflash`" in text
