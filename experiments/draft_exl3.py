"""An EXL3 copy of a (padded) drafter for a device run: exllamav3's convert_model at one bitrate, uncalibrated,
into `out` (reused when complete). The pair bench's `--draft-bits` uses it, since exllamav3's graph-captured
attention (the `graph_draft_swa` lever) takes only EXL3 projections."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from toolkit.core.errors import ToolkitError
from toolkit.quant.convert import converter_args, pin_tap_shift, run_converter


def exl3_draft(source: Path, out: Path, bits: float) -> Path:
    """`out`, converted from `source` at `bits` (a temp folder renamed when complete; nothing left on failure)."""
    if (out / "config.json").is_file():
        return out
    part, work = out.with_name(out.name + ".part"), out.with_name(out.name + ".work")
    for p in (part, work):
        shutil.rmtree(p, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        rc = run_converter(converter_args(source, part, work, bits, None, None, None), out.with_name(out.name + ".log"))
        if rc != 0 or not (part / "config.json").is_file():
            raise ToolkitError(f"converting {source} at {bits} bpw failed (exit {rc}); log {out.name}.log")
        tap_shift = (json.loads((source / "config.json").read_text()).get("dflash_config") or {}).get("tap_shift", 0)
        pin_tap_shift(part, int(tap_shift or 0))
        if (source / "heldout.json").is_file():      # the bench reads the held-out prompts beside the drafter
            shutil.copy(source / "heldout.json", part / "heldout.json")
        part.rename(out)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
