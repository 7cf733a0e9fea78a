"""experiments/draft_exl3.py without exllamav3: the converter is replaced, the folder protocol is checked."""

from __future__ import annotations

import json

import pytest

import experiments.draft_exl3 as dx
from toolkit.core.errors import ToolkitError


def source(tmp_path):
    src = tmp_path / "draft"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"dflash_config": {"tap_shift": 1}}))
    (src / "heldout.json").write_text("{}")
    return src


def test_converts_once_pins_tap_shift_and_keeps_the_heldout_prompts(tmp_path, monkeypatch):
    calls = []

    def fake(args, log):
        out = args[args.index("-o") + 1]
        calls.append(args)
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "exl3"}}))
        return 0

    monkeypatch.setattr(dx, "run_converter", fake)
    src, out = source(tmp_path), tmp_path / "draft-6bpw"
    assert dx.exl3_draft(src, out, 6) == out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["tap_shift"] == 1 and (out / "heldout.json").is_file()
    assert float(calls[0][calls[0].index("-b") + 1]) == 6.0 and "-hess" not in calls[0]
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.work"))
    dx.exl3_draft(src, out, 6)
    assert len(calls) == 1                                   # complete: reused


def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(dx, "run_converter", lambda args, log: 3)
    with pytest.raises(ToolkitError, match="failed \\(exit 3\\)"):
        dx.exl3_draft(source(tmp_path), tmp_path / "draft-6bpw", 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
