"""quantize(): validate, plan, calibrate, convert, check, report, as steps over one Run.

Each step reads what the earlier ones left on the Run and adds its own: the target's config is read once (validate),
the target and the BF16 reference are loaded once (prepare). The pipeline writes OUT only: one folder per bitrate,
report.json / report.md / tau_top1.png. Model cards and the push are publishing (hub/); the command composes them
over the finished run (toolkit/quantize.py). The CLI and Python share one signature: start(**vars(args)).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..core.errors import ToolkitError
from ..core.folders import atomic_dir, read_config
from ..core.target import TargetInfo
from ..dflash import DFlashConfig, DFlashDraft, load_drafter
from ..runtime.backend import encode_chat
from . import calibrate as cal
from . import check as chk
from . import convert as conv
from . import report as rep
from .blocks import Prompt, load_target, run_target
from .plan import MANIFEST, PlanItem, check_out_dir, format_plan, make_plan, plan_json
from .recipe import Recipe, Settings, merge
from .source import resolve, target_kind
from .validate import Checked, linear_keys, unquantized_keys
from .validate import validate as validate_checkpoint

STEPS = ("validate", "plan", "calibrate", "convert", "check", "report")


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
    bar: Any = None                     # the steps' progress bar
    dest: Path | None = None            # where this run writes: OUT, or under --force the folder that replaces it
    model_dir: Path | None = None
    target_config: dict | None = None   # read once, in validate
    checked: Checked | None = None
    items: list[PlanItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dev: str = "cpu"                    # where the target, the reference and the checks run
    target_model: Any = None
    tokenizer: Any = None
    reference: DFlashDraft | None = None
    tap_shift: int = 0
    bf16_tau: float | None = None
    metrics: dict[str, tuple[chk.Metrics, bool]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    report: dict | None = None

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
    def work(self) -> Path:
        return self.s.work_dir or self.dest / ".work"

    @property
    def hessians(self) -> Path:
        return self.work / "hessians"

    @property
    def manifest(self) -> dict:
        return {"model": self.s.model_id, "revision": self.s.revision, "target": self.s.target}


def step(fn: Callable[[Run], None]) -> Callable[[Run], None]:
    """A step on the progress bar: shows its name while it runs and ticks when it is done."""

    @functools.wraps(fn)
    def run_step(run: Run) -> None:
        run.bar.set_description(fn.__name__)
        fn(run)
        run.bar.update()

    return run_step


def read_target_config(run: Run) -> dict | None:
    """The target's config.json (a Hub id fetches it alone); a dry run without it notes that it was not checked."""
    s = run.s
    if not s.target:
        return None
    try:
        folder = resolve(s.target, s.target_revision, "target", config_only=True, cache_only=run.dry_run)
        return read_config(folder, "target")
    except ToolkitError:
        if not run.dry_run:
            raise
        run.notes.append(f"target {s.target} not checked: not a local folder and not in the Hub cache")
        return None


@step
def validate(run: Run) -> None:
    """The drafter checkpoint against its target and the recipe, and OUT against a resume."""
    s = run.s
    run.model_dir = resolve(s.model, s.revision, "model", config_only=run.dry_run, cache_only=run.dry_run)
    run.target_config = read_target_config(run)
    run.checked = validate_checkpoint(run.model_dir, run.target_config, require_weights=not run.dry_run)
    s.recipe.check_expected(run.config)
    check_out_dir(s.out, run.manifest, run.force)


@step
def plan(run: Run) -> None:
    """One row per bitrate (and calibration mode); finished folders are marked done and skipped."""
    s = run.s
    run.items = make_plan(run.config, s.bits, s.out, s.model_id, s.revision, run.calibrate, run.also_uncalibrated,
                          run.force)


def show_plan(run: Run) -> None:
    """--dry-run: the drafter, the plan as a table and the notes."""
    s, c = run.s, run.config
    print(f"model {s.model_id} @ {s.revision or 'unpinned'} ({run.model_dir}), target {s.target or 'none'}")
    print(f"drafter: {c.num_hidden_layers} layers, hidden {c.hidden_size}, block {c.block_size}, "
          f"taps {c.target_layer_ids}, layer types {sorted(set(c.layer_types))}")
    if not run.checked.has_weights:
        run.notes.append("no weights in the model folder: tensors not checked")
    print(format_plan(run.items, s.out))
    for n in run.notes:
        print(f"note: {n}")


def prepare(run: Run) -> None:
    """Refuse what cannot run here before OUT is touched; load the target and the BF16 reference once."""
    s = run.s
    if run.todo and (why := conv.converter_unavailable()):
        raise ToolkitError(why)
    if (run.calibrate or run.check) and not s.target:
        raise ToolkitError("--target is needed to calibrate and check (or pass --no-calibrate --no-check)")
    if run.check:
        check_prompts(s.recipe)
    run.dev = run.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not (run.calibrate or run.check):
        return
    if target_kind(run.target_config) == "exl3":
        raise ToolkitError(f"--target: {s.target} is EXL3; calibration and the check need its BF16 (transformers) "
                           "weights")
    run.target_model, run.tokenizer = load_target(resolve(s.target, s.target_revision, "target"), run.dev)
    run.reference = load_drafter(run.model_dir, dtype=torch.float32, device=run.dev)


def check_prompts(recipe: Recipe) -> None:
    if not recipe.check_prompts:
        raise ToolkitError("recipe: no [check] prompts (or pass --no-check)")
    if set(recipe.calibration_prompts) & set(recipe.check_prompts):
        raise ToolkitError("recipe: [check] prompts must be held out; some are also [calibration] prompts")


@contextmanager
def output(run: Run) -> Iterator[None]:
    """Write into OUT (resuming an earlier run), or under --force into a folder beside a non-empty OUT that
    replaces it only once the run is complete; a run that stops leaves the old OUT as it was."""
    if run.force and run.out.is_dir() and any(run.out.iterdir()):
        with atomic_dir(run.out) as tmp:
            begin(run, tmp)
            yield
        run.dest = run.out
    else:
        begin(run, run.out)
        yield


def begin(run: Run, dest: Path) -> None:
    """Open the folder this run writes, with the manifest that lets a later run resume it."""
    run.dest = dest
    dest.mkdir(parents=True, exist_ok=True)
    conv.write_text(dest / MANIFEST, json.dumps(run.manifest) + "\n")


def encode(run: Run, texts: list[str]) -> list[list[int]]:
    """Prompt ids through the target's chat template, as the runtime encodes them."""
    return [encode_chat(run.tokenizer, t) for t in texts]


@step
def calibrate(run: Run) -> None:
    """Input Hessians of every Linear from the target's hidden states, once for all calibrated bitrates."""
    r = run.s.recipe
    if run.calibrate and any(i.calibrated for i in run.todo):
        cal.calibrate(run.reference, run.target_model, encode(run, r.calibration_prompts), linear_keys(run.config),
                      r.anchors_per_prompt, run.hessians, run.progress, continue_tokens=r.max_new_tokens)


@step
def convert(run: Run) -> None:
    """Each unfinished bitrate through exllamav3, into a folder that appears only when complete."""
    s, keep = run.s, unquantized_keys(run.config)
    for item in tqdm(run.todo, desc="convert", unit="bitrate", disable=not run.progress, leave=False):
        conv.convert_bitrate(item, run.model_dir, run.dest, run.work, run.checked.tensors, keep, s.model_id, s.revision,
                             run.config.tap_shift, run.hessians if item.calibrated else None, s.recipe.overrides,
                             run.device)
        item.status = "done"


@step
def check(run: Run) -> None:
    """Verify tap_shift on held-out prompts, then measure every bitrate against the BF16 reference and judge it."""
    run.tap_shift = run.config.tap_shift
    if not run.check:
        return
    ids = encode(run, run.s.recipe.check_prompts)
    prompts = pick_tap_shift(run, ids)
    run.bf16_tau = chk.measure_tau(run.target_model, run.tokenizer, run.reference, ids, run.s.recipe.max_new_tokens,
                                   run.tap_shift)
    for item in tqdm(run.items, desc="check", unit="bitrate", disable=not run.progress, leave=False):
        judge(run, item, ids, prompts)
    run.notes.append("τ: greedy decoding through the torch runtime, EXL3 weights dequantized by exllamav3")


def pick_tap_shift(run: Run, ids: list[list[int]]) -> list[Prompt]:
    """The recipe's candidate shifts that name target layers, scored by agreement with the target; the best wins."""
    r, c = run.s.recipe, run.config
    layers = TargetInfo(run.target_config or {}).num_layers or 1 << 30   # tap L + shift must name a target layer
    shifts = [x for x in r.tap_shift_candidates if all(0 <= t + x < layers for t in c.target_layer_ids)]
    prompts = [run_target(run.target_model, i, c, sorted(set(shifts) | {c.tap_shift}), r.max_new_tokens) for i in ids]
    run.tap_shift, scores = chk.pick_tap_shift(run.reference, prompts, run.target_model, r.anchors_per_prompt, shifts)
    run.notes.append("tap_shift agreement with the target: " + ", ".join(f"{k}: {v:.3f}" for k, v in scores.items())
                     + f" -> {run.tap_shift}")
    return prompts


def judge(run: Run, item: PlanItem, ids: list[list[int]], prompts: list[Prompt]) -> None:
    """KL, top-1 and τ of one bitrate against the reference, judged by the recipe; its config gets the tap_shift."""
    r, folder = run.s.recipe, run.dest / item.folder
    qd = chk.load_quantized(folder, run.config, run.dev)
    m = chk.compare(run.reference, qd, prompts, run.target_model, r.anchors_per_prompt, run.tap_shift)
    m.tau = chk.measure_tau(run.target_model, run.tokenizer, qd, ids, r.max_new_tokens, run.tap_shift)
    ok, why = chk.judge(m, r.thresholds_for(item.bits), run.bf16_tau)
    run.metrics[item.folder] = (m, ok)
    if not ok:
        run.failures.append(f"{item.folder}: " + "; ".join(why))
    conv.pin_tap_shift(folder, run.tap_shift)


@step
def report(run: Run) -> None:
    """report.json (the measurements), report.md (with the notes) and tau_top1.png."""
    s, c = run.s, run.config
    results = [rep.result_row(i, conv.folder_size(run.dest / i.folder), *(run.metrics.get(i.folder) or (None, None)))
               for i in run.items]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    run.report = rep.build_report(s.model_id, s.revision, s.target, c.block_size, run.tap_shift, device, run.bf16_tau,
                                  run.checked.size_bytes, results)
    rep.write_report(run.dest, run.report, run.notes)


def start(recipe: str | None = None, model: str | None = None, revision: str | None = None, target: str | None = None,
          bits: str | list | None = None, out: str | None = None, work_dir: str | None = None, calibrate: bool = True,
          also_uncalibrated: bool = False, check: bool = True, dry_run: bool = False, force: bool = False,
          device: str | None = None, progress: bool = True) -> Run:
    """A Run from the recipe and the command line (flags win); nothing is read or written yet."""
    s = merge(recipe, model, revision, target, bits, out, work_dir)
    return Run(s, calibrate, also_uncalibrated, check, dry_run, force, device, progress)


def execute(run: Run) -> Run:
    """The steps in order; a dry run prints the plan and stops there. Thresholds are not enforced here."""
    run.bar = tqdm(total=len(STEPS), desc="quantize", unit="step", disable=not run.progress or run.dry_run)
    with run.bar:
        validate(run)
        plan(run)
        if run.dry_run:
            show_plan(run)
            return run
        prepare(run)
        with output(run):
            calibrate(run)
            convert(run)
            check(run)
            report(run)
    return run


def enforce(run: Run) -> None:
    """Fail a finished run whose bitrates missed the recipe's thresholds (its report stays in OUT)."""
    if run.failures:
        raise ToolkitError(f"below the recipe's thresholds: {' | '.join(run.failures)} "
                           f"(report in {run.out / 'report.md'})")


def quantize(**options) -> dict | int:
    """Convert a DFlash drafter to EXL3 at several bitrates (options: those of start); returns the report, or 0
    for a dry run. Writes no model cards and pushes nothing: toolkit.quantize composes those from hub/."""
    run = execute(start(**options))
    if run.dry_run:
        return 0
    enforce(run)
    return run.report


__all__ = ["Run", "enforce", "execute", "plan_json", "quantize", "start"]
