"""The shipped SmolLM2 drafter: its weights are the pinned ones, and a damaged copy is one error line."""

from __future__ import annotations

import pytest

from toolkit.assets.smollm2 import DRAFT, DRAFT_SHA256, check_drafter
from toolkit.core.errors import ToolkitError


def test_the_shipped_drafter_matches_its_pin():
    check_drafter()            # a new drafter ships only with a new pin (one version in the repository at a time)
    assert len(DRAFT_SHA256) == 64


def test_a_damaged_drafter_is_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ToolkitError, match=r"damaged or missing \(checksum mismatch\)") as e:
        check_drafter(tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(ToolkitError, match="damaged or missing"):
        check_drafter(tmp_path / "nowhere")
    assert (DRAFT / "config.json").is_file()
