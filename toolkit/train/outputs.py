"""What a training run writes, under the output policy (core.folders, docs/outputs.md).

--out is the drafter folder, replaced atomically at the end and only when it is train_drafter's own earlier output
(its marker) or with --force. The checkpoint folder (--checkpoint-dir, default OUT.ckpt) holds the resumable state:
it must be new, empty or an earlier run's checkpoint folder (its own marker; --force never applies to it) and is
removed after the final save, unless the run trains in pieces (--time-limit), where it is kept for the next piece
or an --extend (train/checkpoint.py says what it holds). Both are held while a run uses them (core.locks): a second
run on either is refused. --curve is a PNG that carries the toolkit's marker; an existing file without it is never
replaced. Checkpoints are written through a temp folder, so a full disk or an interrupt leaves no partial one.
"""

from __future__ import annotations

import io
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..core.errors import OptionError
from ..core.folders import atomic_write, claim, claim_file, mark, marker, owner, read_config
from ..core.locks import hold
from .config import TrainConfig

COMMAND = "train_drafter"
CHECKPOINTS = "train_drafter.checkpoints"     # the checkpoint folder's marker: never mistaken for a drafter folder


@dataclass
class Outputs:
    out: Path
    ckdir: Path
    curve: Path | None


def claim_outputs(out: str, checkpoint_dir: str | None, curve: str | None, force: bool) -> Outputs:
    """Check --out, --checkpoint-dir and --curve before any work (docs/outputs.md)."""
    o = claim(out, COMMAND, force)
    ck = Path(checkpoint_dir).expanduser() if checkpoint_dir is not None else o.with_name(o.name + ".ckpt")
    claim(ck, CHECKPOINTS, False, field="checkpoint_dir", force_flag=None)     # --force never applies to it
    full_o, full_ck = o.resolve(), ck.resolve()
    if full_o == full_ck or full_o in full_ck.parents or full_ck in full_o.parents:
        raise OptionError("checkpoint_dir", f"{ck} overlaps --out {o}: name a folder beside it")
    c = None
    if curve is not None:
        c = claim_file(curve, "curve", command=COMMAND, kind="PNG")
        if c.suffix.lower() != ".png":
            raise OptionError("curve", f"{c} must name a .png file")
    return Outputs(o, ck, c)


def check_run(cfg: TrainConfig) -> tuple[Outputs, dict]:
    """What a run checks before it reads or loads anything else, without torch: the options (TrainConfig.check), its
    outputs (claim_outputs) and the target's config.json; returns (the outputs, that config)."""
    cfg.check()
    outs = claim_outputs(cfg.out, cfg.checkpoint_dir, cfg.curve, cfg.force)
    return outs, read_config(cfg.target, "target")


@contextmanager
def held(outs: Outputs) -> Iterator[None]:
    """--out and the checkpoint folder held for the run (core.locks): a second run on either is one line."""
    with hold(outs.out, COMMAND), hold(outs.ckdir, CHECKPOINTS, "checkpoint_dir"):
        yield


def checkpoints(ck: Path, resume: bool) -> Path:
    """The checkpoint folder for the run: created and marked if new."""
    if resume and not (ck / "state" / "checkpoint.json").is_file():
        raise OptionError("resume", f": no checkpoint in {ck}")
    ck.mkdir(parents=True, exist_ok=True)
    if owner(ck) != CHECKPOINTS:
        mark(ck, CHECKPOINTS)
    return ck


def remove_checkpoints(ck: Path) -> None:
    """Delete the checkpoint folder after the final save: only one that carries the checkpoint marker."""
    if owner(ck) == CHECKPOINTS:
        shutil.rmtree(ck, ignore_errors=True)


def save_torch(obj, path: Path) -> None:
    """torch.save through a temp file renamed into place; a full disk is one line and leaves nothing."""
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))


def write_curve(fig, path: Path) -> None:
    """The curve's figure as a PNG that carries the toolkit's marker (so a rerun may replace it)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"dflash-toolkit": json.dumps(marker(COMMAND))})
    atomic_write(path, lambda f: f.write(buf.getvalue()))
