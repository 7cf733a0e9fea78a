"""The state of one quantize run, and the `step` wrapper that shows, times and measures each step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import OptionError
from ..dflash import DFlashConfig, DFlashDraft
from ..runtime.placement import GpuSplit
from . import check as chk
from .blocks import Prompt
from .memory import Meter, Need, Phases
from .plan import PlanItem
from .recipe import Settings
from .validate import Checked

STEPS = ("validate", "plan", "target", "calibrate", "convert", "check", "speed", "report")


@dataclass
class Run:
    """One quantize run: the settings and switches, then what each step has learned so far."""

    s: Settings
    calibrate: bool = True
    also_uncalibrated: bool = False
    check: bool = True
    dry_run: bool = False
    force: bool = False
    device: str | None = None           # as given: the converter's GPU (cpu still converts on GPU 0)
    progress: bool = True
    split: GpuSplit = field(default_factory=GpuSplit)   # the EXL3 target's GPUs and the drafter's (exllamav3 steps)
    on_step: Callable[[dict], None] | None = None       # called with each step's timing row as the step ends
    bar: Any = None                     # the steps' progress bar
    dest: Path | None = None            # where this run writes: OUT, or under --force the folder that replaces it
    model_dir: Path | None = None
    model_sha: str | None = None        # the commit a Hub --model resolved to (None: a local folder)
    target_dir: Path | None = None      # config only until prepare fetches the whole target
    target_sha: str | None = None
    target_weights: int | None = None   # GPU bytes of the target's weights (None: unknown, e.g. not downloaded)
    target_config: dict | None = None   # read once, in validate
    kind: str = "none"                  # the target: exl3 (runs on exllamav3) | hf (transformers) | none
    checked: Checked | None = None
    items: list[PlanItem] = field(default_factory=list)
    needs: list[Need] = field(default_factory=list)       # the plan's GPU memory per step
    notes: list[str] = field(default_factory=list)
    dev: str = "cpu"                    # where the torch models (reference, transformers target) run
    tokenizer: Any = None
    target_model: Any = None            # a transformers target, loaded for the whole run
    parts: Any = None                   # an EXL3 target's embedding table and LM head (target.Parts)
    reference: DFlashDraft | None = None
    cal_ids: list[list[int]] = field(default_factory=list)
    held_ids: list[list[int]] = field(default_factory=list)
    cal_prompts: list[Prompt] = field(default_factory=list)
    held: list[Prompt] = field(default_factory=list)
    tap_shift: int = 0
    bf16_tau: float | None = None
    metrics: dict[str, chk.Metrics] = field(default_factory=dict)
    exl3: dict[str, dict] = field(default_factory=dict)   # folder -> τ and speed on exllamav3
    bf16_exl3: dict | None = None
    exl3_widths: list[dict] = field(default_factory=list)
    recommended: int | None = None      # draft tokens per round with the best measured speedup
    timings: list[dict] = field(default_factory=list)
    phases: Phases = field(default_factory=Phases)      # the running step's phases (a step may measure some)
    failures: list[str] = field(default_factory=list)
    report: dict | None = None
    offline: dict[str, dict] = field(default_factory=dict)   # dry run: model/target configs read from the recipe's shapes

    @property
    def out(self) -> Path:
        return self.s.out

    @property
    def config(self) -> DFlashConfig:
        return self.checked.config

    @property
    def todo(self) -> list[PlanItem]:
        return [i for i in self.items if i.status != "done"]

    @property
    def calibrating(self) -> bool:
        """Whether this run computes Hessians: calibration on and a calibrated bitrate still to convert."""
        return self.calibrate and any(i.calibrated for i in self.todo)

    @property
    def lm(self):
        """What calibration and the check read of the target: the transformers model, or the EXL3 target's Parts."""
        return self.target_model if self.target_model is not None else self.parts

    @property
    def work(self) -> Path:
        return self.s.work_dir or self.dest / ".work"

    @property
    def hessians(self) -> Path:
        return self.work / "hessians"

    @property
    def manifest(self) -> dict:
        return {"model": self.s.model_id, "revision": self.s.revision, "target": self.s.target}

    def split_kw(self) -> dict:
        """`split=` for the engine's loads, only when the target is not simply on GPU 0."""
        return {} if self.split.default else {"split": self.split}

    def check_split(self, uses_target: bool) -> None:
        """A GPU split places an EXL3 target on exllamav3: refuse it, naming the option, for any other run."""
        if self.split.default or (uses_target and self.kind == "exl3"):
            return
        sp = self.split
        field = "gpu_split" if sp.gpu_split else "tensor_parallel" if sp.tensor_parallel else "draft_device"
        raise OptionError(field, f"places an EXL3 target on exllamav3 (got {sp.tag}); this run loads "
                                 + ("a transformers target" if self.kind == "hf" and uses_target else "no EXL3 target"))

    def estimate(self, name: str) -> int | None:
        return next((n.total for n in self.needs if n.step == name), None)


def step(fn: Callable[[Run], None]) -> Callable[[Run], None]:
    """A step on the progress bar (its name while it runs, a tick when done), timed and its GPU peak measured (and
    its phases', when it measures some in run.phases); the row goes to run.timings and, as the step ends, to
    run.on_step (so a run cut off later still tells it)."""

    @functools.wraps(fn)
    def run_step(run: Run) -> None:
        run.bar.set_description(fn.__name__)
        run.phases = Phases(enabled=not run.dry_run)
        with Meter(enabled=not run.dry_run) as m:        # a dry run touches no GPU
            fn(run)
        row = run.phases.fold(m.row(fn.__name__, run.estimate(fn.__name__)))
        run.timings.append(row)
        if run.on_step is not None:
            run.on_step(dict(row))
        run.bar.update()

    return run_step
