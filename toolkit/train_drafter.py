"""`python -m toolkit.train_drafter`: train a DFlash drafter for a local target on its own greedy answers."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from .core.cli import entry, run
from .train.config import TrainConfig
from .train.outputs import check_run

DOC = ast.get_docstring(ast.parse((Path(__file__).parent / "train" / "trainer.py").read_text()))  # without torch


def train_drafter(**options) -> dict:
    """The run checked first (train/outputs.py's check_run: options, outputs, the target's config, without torch), then
    the trainer, imported on use: torch loads only for a run, not for --help or bad input."""
    cfg = TrainConfig(**options)
    checked = check_run(cfg)
    from .train.trainer import train_checked

    return train_checked(cfg, *checked)


EXAMPLE = (" Example (GPU, SmolLM2): python -m toolkit.train_drafter --target ~/.cache/dflash-toolkit/smollm2-135m-instruct "
           "--out smol-dflash --minutes 8. At scale, generate the answers first (experiments/smol_scale.py gen) and pass "
           "--data. In pieces of at most ten minutes: add --steps TOTAL --time-limit 540 --checkpoint-precision compact, "
           "and --resume from the second piece on (docs/app.md).")


def main(argv: list[str] | None = None) -> None:
    info = run(train_drafter, TrainConfig, argv, "python -m toolkit.train_drafter", DOC.split("\n\n")[0],
               DOC.split("\n\n")[1] + EXAMPLE, output_policy=True)
    keys = ("params", "sequences", "steps", "planned_steps", "piece", "complete", "stopped", "seconds")
    print(json.dumps({k: info[k] for k in keys} | {"best": info["best"], "out": info["config"]["out"] if info["written"] else None}))


if __name__ == "__main__":
    entry(main)
