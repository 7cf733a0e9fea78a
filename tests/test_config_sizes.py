"""Config sizes are positive or refused: a context length, vocab, layer or head count, width or block size of 0 or
below in a target's or a drafter's config.json is one line at load, never read as "no limit"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.core.errors import ToolkitError, run_cli
from toolkit.core.target import SIZES, TargetInfo

PAIR = Path(__file__).resolve().parents[1] / "toolkit" / "data" / "tiny_pair"
DRAFT_SIZES = [*SIZES, "block_size", "sliding_window", "num_target_layers"]


def edited(src: Path, dst: Path, key: str, value, text_config: bool = False) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if text_config:                                   # a multimodal layout: the language model's config nested
        cfg = {"architectures": cfg["architectures"], "model_type": cfg["model_type"], "text_config": cfg}
    if key == "block_size":
        cfg["dflash_config"][key] = value
    (cfg["text_config"] if text_config else cfg)[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("key", sorted(SIZES))
def test_a_target_size_below_one_is_one_line_at_load(tmp_path, key, value):
    for nested in (False, True):
        folder = edited(PAIR / "target", tmp_path / f"t{nested}", key, value, nested)
        with pytest.raises(ToolkitError) as e:
            TargetInfo.read(folder, "target")
        msg = str(e.value)
        assert "\n" not in msg and str(folder / "config.json") in msg and f"{key} must be a whole number from 1" in msg
        assert f"got {value}" in msg and ("text_config." in msg) == nested


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("key", sorted(DRAFT_SIZES))
def test_a_drafter_size_below_one_is_one_line_at_load(tmp_path, key, value):
    from toolkit.dflash import DFlashConfig, load_drafter

    folder = edited(PAIR / "draft", tmp_path / "d", key, value)
    for load in (lambda: DFlashConfig.from_dir(folder), lambda: load_drafter(folder)):
        with pytest.raises(ToolkitError) as e:
            load()
        msg = str(e.value)
        assert "\n" not in msg and f"{key} must be a whole number from" in msg and f"got {value}" in msg, msg


def test_a_target_with_no_context_is_refused_not_run_without_a_limit(tmp_path, capsys):
    """max_position_embeddings 0 used to turn the context check off; generate now stops at load, in one line."""
    from toolkit import generate

    folder = edited(PAIR / "target", tmp_path / "t", "max_position_embeddings", 0)
    with pytest.raises(SystemExit) as code:
        run_cli(lambda: generate.main(["--target", str(folder), "--draft", str(PAIR / "draft"), "--prompt", "hi",
                                       "--max-new-tokens", "4"]))
    err = capsys.readouterr().err
    assert code.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: ") and "max_position_embeddings must be" in err
    assert TargetInfo(json.loads((PAIR / "target" / "config.json").read_text())).max_context == 1024
    assert TargetInfo({}).max_context > 10**6                      # absent: no limit worth checking
