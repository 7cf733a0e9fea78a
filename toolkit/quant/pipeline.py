"""quantize(): validate, plan, target, calibrate, convert, check, speed, report, as steps over one Run.

Each step reads what the earlier ones left on the Run, adds its own, and is timed with its peak GPU memory
(report.json's `steps`). A BF16 target stays loaded; an EXL3 one runs on exllamav3 once for the prompts'
continuations and taps, and again in `speed`, with each drafter swapped in, for τ and tok/s on the engine users
serve with. The pipeline writes OUT only (a folder per bitrate, report.json / report.md / tau_top1.png); cards and
the push are hub/'s, composed by toolkit/quantize.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ..core.errors import ToolkitError
from ..core.folders import atomic_dir, claim, mark, owner, read_config
from ..dflash import load_drafter
from ..runtime.backend import encode_chat
from ..exl3.taps import free_gpu
from ..runtime.placement import GpuSplit
from . import calibrate as cal
from . import check as chk
from . import convert as conv
from . import engine
from . import memory as mem
from . import offline
from . import report as rep
from . import speed as spd
from .options import QuantizeOptions, settings
from .plan import MANIFEST, check_out_dir, make_plan, plan_json
from .recipe import Recipe, Settings
from .run import STEPS, Run, step

WORK = "quantize.work"               # the marker of a --work-dir folder
from .source import fetch_ref, target_kind
from .target import exl3_opener, exl3_target, fitting_shifts, hf_prompts, target_bits, target_shifts
from .validate import check_finite_weights, check_shift_candidates, linear_keys, unquantized_keys
from .validate import validate as validate_checkpoint


def read_target_config(run: Run) -> dict | None:
    """The target's config.json (a Hub ref fetches it alone); a dry run without it notes that it was not checked."""
    s = run.s
    if not s.target:
        return None
    try:
        run.target_dir, run.target_sha = offline.fetch_or_shapes(run, s.target, s.target_revision, "target", True)
        return read_config(run.target_dir, "target")
    except ToolkitError:
        if not run.dry_run:
            raise
    planned = offline.planned_target(run, s.target)      # not made or downloaded yet: the recipe's target shape
    if planned is None:
        run.notes.append(f"target {s.target} not checked: not a local folder and not in the Hub cache")
        return None
    run.target_dir, run.target_sha = planned
    return read_config(run.target_dir, "target")


@step
def validate(run: Run) -> None:
    """The drafter checkpoint against its target and the recipe, and OUT against a resume."""
    s = run.s
    run.model_dir, run.model_sha = offline.fetch_or_shapes(run, s.model, s.revision, "model", run.dry_run)
    run.target_config = read_target_config(run)
    run.kind = target_kind(run.target_config) if run.target_config is not None else "none"
    run.checked = validate_checkpoint(run.model_dir, run.target_config, require_weights=not run.dry_run,
                                      target=s.target)
    s.recipe.check_expected(run.config)
    if run.check:
        check_shift_candidates(s.recipe.tap_shift_candidates, run.config, run.target_config)
    check_out_dir(s.out, run.manifest, run.force)
    if s.work_dir is not None:       # a scratch folder of ours: new, empty or an earlier run's (its marker)
        claim(s.work_dir, WORK, False, field="work_dir", force_flag=None)


@step
def plan(run: Run) -> None:
    """One row per bitrate (and calibration mode), finished folders marked done; the GPU memory per step."""
    s = run.s
    run.items = make_plan(run.config, s.bits, s.out, s.model_id, s.revision, run.calibrate, run.also_uncalibrated,
                          run.force)
    run.needs = plan_memory(run)


def plan_memory(run: Run, max_prompt: int = mem.PROMPT_TOKENS) -> list[mem.Need]:
    r, folder, cfg = run.s.recipe, run.target_dir, run.target_config or {}
    run.target_weights = offline.target_weights(run, folder, cfg)
    n = len(r.calibration_prompts) + len(r.check_prompts)
    sizes = mem.Sizes(run.kind, run.config, cfg, run.target_weights, max_prompt, r.max_new_tokens, n)
    return mem.plan_memory(sizes, run.calibrating, bool(run.todo), run.check)


def prepare(run: Run) -> None:
    """Refuse what cannot run here before OUT is touched: the EXL3 target's engine, the converter, the prompts,
    the GPU memory of the plan's biggest step; fetch the target and tokenize the prompts."""
    s, r = run.s, run.s.recipe
    check_finite_weights(run.model_dir)          # a NaN drafter is never converted, reported or pushed
    run.dev = run.device or ("cuda" if torch.cuda.is_available() else "cpu")
    uses_target = run.calibrate or run.check
    if uses_target and not s.target:
        raise ToolkitError("--target is needed to calibrate and check (or pass --no-calibrate --no-check)")
    if uses_target and run.kind == "exl3" and (why := engine.ENGINE.unavailable(s.target)):
        raise ToolkitError(why)
    run.check_split(uses_target)
    if run.todo and (why := conv.converter_unavailable()):
        raise ToolkitError(why)
    if run.check:
        check_prompts(r)
    if run.calibrating and not r.calibration_prompts:
        raise ToolkitError("calibration: the recipe has no [calibration] prompts (or pass --no-calibrate)")
    if not (run.calibrating or run.check):
        return
    from ..runtime.hf import load_hf_tokenizer

    run.tokenizer = load_hf_tokenizer(run.target_dir, "--target")      # fetched with the config (source.CONFIG_FILES)
    run.cal_ids = encode(run, r.calibration_prompts) if run.calibrating else []
    run.held_ids = encode(run, r.check_prompts) if run.check else []
    longest = max(map(len, run.cal_ids + run.held_ids), default=mem.PROMPT_TOKENS)
    run.needs = plan_memory(run, longest)
    check_fits(run)                      # the weights' size from a Hub ref's index, before they are downloaded
    run.target_dir, run.target_sha = fetch_ref(s.target, s.target_revision, "target")
    run.needs = plan_memory(run, longest)
    check_fits(run)


def check_fits(run: Run) -> None:
    """One line when the plan's biggest step needs more GPU memory than is free (estimated before loading)."""
    top = mem.peak(run.needs)
    if top is None or not (run.kind == "exl3" or run.dev.startswith("cuda")):
        return
    free = engine.ENGINE.free_bytes(**run.split_kw()) if run.kind == "exl3" else engine.ENGINE.free_bytes()
    if top.total > free:
        parts = ", ".join(f"{k} {mem.gib(v)}" for k, v in top.parts.items() if v)
        head = f"--target: {run.s.target} does not fit" if top.parts.get("target weights") else "this run does not fit"
        raise ToolkitError(f"{head} in GPU memory: step {top.step} needs about "
                           f"{mem.gib(top.total)} ({parts}, reserve {mem.gib(mem.RESERVE)}), "
                           + (f"the GPU has {mem.gib(free)} free" if run.split.default or run.kind != "exl3"
                              else f"the GPUs of {run.split.tag} have {mem.gib(free)} free together"))


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
    if run.s.work_dir is not None:
        run.s.work_dir.mkdir(parents=True, exist_ok=True)
        if owner(run.s.work_dir) != WORK:
            mark(run.s.work_dir, WORK)


def encode(run: Run, texts: list[str]) -> list[list[int]]:
    """Prompt ids through the target's chat template, as the runtime encodes them."""
    return [encode_chat(run.tokenizer, t) for t in texts]


def check_shifts(run: Run) -> list[int]:
    """The recipe's candidate tap_shifts that name target layers (tap L + shift must be a layer of the target)."""
    return fitting_shifts(run.s.recipe.tap_shift_candidates, run.config, run.target_config)


@step
def target(run: Run) -> None:
    """Every prompt through the target: its greedy continuation, greedy tokens and taps. An EXL3 target is loaded
    for this alone, hands over its embedding table and LM head, and is unloaded; its phases are measured."""
    if not (run.cal_ids or run.held_ids):
        return
    r, c = run.s.recipe, run.config
    shifts = target_shifts(r.tap_shift_candidates, c, run.target_config)
    if run.kind == "exl3":
        opened = exl3_opener(engine.ENGINE.open_target, run.target_dir, run.cal_ids + run.held_ids, r.max_new_tokens,
                             **run.split_kw())
        run.cal_prompts, run.held, run.parts = exl3_target(opened, run.cal_ids, run.held_ids, c, shifts,
                                                           r.max_new_tokens, run.phases.phase)
        return
    from .blocks import load_target

    run.target_model, _ = load_target(run.target_dir, run.dev)
    run.cal_prompts = hf_prompts(run.target_model, run.cal_ids, c, [c.tap_shift], r.max_new_tokens)
    run.held = hf_prompts(run.target_model, run.held_ids, c, shifts, r.max_new_tokens)


def reference(run: Run):
    """The BF16 drafter as a float32 torch module on the run's device (loaded once, parked on the CPU between uses)."""
    if run.reference is None:
        run.reference = load_drafter(run.model_dir, dtype=torch.float32, device=run.dev)
    return run.reference.to(run.dev)


def park(run: Run) -> None:
    """Move the torch models off the GPU while exllamav3 (the converter, the target) needs it."""
    if run.reference is not None:
        run.reference.to("cpu")
    if run.parts is not None:
        run.parts.head_to("cpu")
    free_gpu()


@step
def calibrate(run: Run) -> None:
    """Input Hessians of every Linear from the target's taps, once for all calibrated bitrates."""
    if run.calibrating:
        r = run.s.recipe
        cal.calibrate_prompts(reference(run), run.cal_prompts, run.lm.get_input_embeddings().weight,
                              linear_keys(run.config), r.anchors_per_prompt, run.hessians, run.progress,
                              total=len(run.cal_prompts))
        run.cal_prompts = []


@step
def convert(run: Run) -> None:
    """Each unfinished bitrate through exllamav3, into a folder that appears only when complete."""
    s, keep = run.s, unquantized_keys(run.config)
    park(run)
    for item in tqdm(run.todo, desc="convert", unit="bitrate", disable=not run.progress, leave=False):
        conv.convert_bitrate(item, run.model_dir, run.dest, run.work, run.checked.tensors, keep, s.model_id, s.revision,
                             run.config.tap_shift, run.hessians if item.calibrated else None, s.recipe.overrides,
                             run.device)
        item.status = "done"


@step
def check(run: Run) -> None:
    """Verify tap_shift on held-out prompts, then KL and top-1 of every bitrate against the BF16 reference (and τ
    through the torch runtime with a BF16 target); pin the tap_shift into each folder."""
    run.tap_shift = run.config.tap_shift
    if not run.check:
        return
    r, ref = run.s.recipe, reference(run)
    if run.parts is not None:
        run.parts.head_to(run.dev)
    run.tap_shift, scores = chk.pick_tap_shift(ref, run.held, run.lm, r.anchors_per_prompt, check_shifts(run))
    run.notes.append("tap_shift agreement with the target: " + ", ".join(f"{k}: {v:.3f}" for k, v in scores.items())
                     + f" -> {run.tap_shift}")
    if run.kind == "hf":
        run.bf16_tau = chk.measure_tau(run.target_model, run.tokenizer, ref, run.held_ids, r.max_new_tokens, run.tap_shift)
    for item in tqdm(run.items, desc="check", unit="bitrate", disable=not run.progress, leave=False):
        folder = run.dest / item.folder
        qd = chk.load_quantized(folder, run.config, run.dev)
        m = chk.compare(ref, qd, run.held, run.lm, r.anchors_per_prompt, run.tap_shift)
        if run.kind == "hf":
            m.tau = chk.measure_tau(run.target_model, run.tokenizer, qd, run.held_ids, r.max_new_tokens, run.tap_shift)
        run.metrics[item.folder] = m
        conv.pin_tap_shift(folder, run.tap_shift)
        del qd
    if run.kind == "hf":
        run.notes.append("τ: greedy decoding through the torch runtime, EXL3 weights dequantized by exllamav3")
    park(run)


@step
def speed(run: Run) -> None:
    """With an EXL3 target: τ, acceptance per position and tok/s against AR of the BF16 drafter at each draft width
    (the best speedup is the recommended width), then of every bitrate at that width, on exllamav3."""
    if not (run.check and run.kind == "exl3"):
        return
    s, r, c = run.s, run.s.recipe, run.config
    n = max(map(len, run.held_ids))
    setup = spd.SpeedSetup(run.target_dir, s.target, target_bits(run.target_config), run.held_ids, r.max_new_tokens,
                           mem.job_tokens(n, r.max_new_tokens, c.block_size), run.split_kw())
    ref_dir = spd.shadow_reference(run.model_dir, run.work / "bf16-reference", run.tap_shift)
    with spd.loaded(engine.ENGINE, setup, ref_dir) as be:       # one target load; the drafters are swapped in
        ar = spd.baseline(be, setup)
        sweep, skipped = spd.sweep(be, setup, spd.widths_for(c.block_size, r.draft_tokens), ar)
        run.exl3_widths = [sweep[w] for w in sorted(sweep)]
        if skipped:
            run.notes.append(f"draft tokens {', '.join(map(str, skipped))} not measured: no round at {max(sweep)} "
                             "accepted its whole window, so a wider one accepts the same tokens at a higher cost")
        run.recommended = spd.best_width(sweep) or max(sweep)
        run.bf16_exl3 = sweep.get(run.recommended)
        for item in tqdm(run.items, desc="speed", unit="bitrate", disable=not run.progress, leave=False):
            engine.ENGINE.swap_draft(be, run.dest / item.folder)
            run.exl3[item.folder] = spd.measure(be, setup, [run.recommended], ar)[run.recommended]
    if all((x.get("speedup") or 0) < 1 for x in run.exl3_widths):
        run.notes.append("speculative decoding was slower than AR at every measured draft width")


def verdicts(run: Run) -> dict[str, bool]:
    """Each measured bitrate judged by the recipe; τ is exllamav3's with an EXL3 target, the torch runtime's else."""
    out, r = {}, run.s.recipe
    bf16 = run.bf16_exl3["tau"] if run.bf16_exl3 else run.bf16_tau
    for item in run.items:
        m = run.metrics.get(item.folder)
        if m is None:
            continue
        x = run.exl3.get(item.folder)
        ok, why = chk.judge(dataclasses.replace(m, tau=x["tau"]) if x else m, r.thresholds_for(item.bits), bf16)
        out[item.folder] = ok
        if not ok:
            run.failures.append(f"{item.folder}: " + "; ".join(why))
    return out


@step
def report(run: Run) -> None:
    """report.json (the measurements, the step table), report.md (with the notes) and tau_top1.png."""
    s, c = run.s, run.config
    passed = verdicts(run)
    results = [rep.result_row(i, conv.folder_size(run.dest / i.folder), run.metrics.get(i.folder),
                              passed.get(i.folder), run.exl3.get(i.folder)) for i in run.items]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    run.report = rep.build_report(
        s.model_id, s.revision, s.target, c.block_size, run.tap_shift, device, run.bf16_tau, run.checked.size_bytes,
        results, model_sha=run.model_sha, target_sha=run.target_sha, target_kind=run.kind, bf16_exl3=run.bf16_exl3,
        target_model=s.target_model, model_local=s.model_local, target_local=s.target_local,
        exl3_widths=run.exl3_widths, recommended_draft_tokens=run.recommended, steps=list(run.timings),
        memory=mem.summary(run.timings, run.needs),
        engine_ran=bool(run.exl3 or run.bf16_exl3) or any(rep.made_by_exllamav3(run.dest / i.folder) for i in run.items))
    rep.write_report(run.dest, run.report, run.notes)


def start(o: QuantizeOptions, progress: bool = True, on_step: Callable[[dict], None] | None = None,
          s: Settings | None = None) -> Run:
    """A Run from the options `o` (those of `python -m toolkit.quantize`) and the recipe they name (flags win; `s`:
    their `settings(o)`, when already read); nothing else is read or written yet. gpu_split, tensor_parallel and
    draft_device place an EXL3 target (and the drafter of the speed step) across GPUs; `progress` shows the progress
    bars; on_step gets each step's row of report.json's `steps` as the step ends (a device script records them)."""
    s = s or settings(o)
    split = GpuSplit.of(o.gpu_split, o.tensor_parallel, o.draft_device)
    return Run(s, o.calibrate, o.also_uncalibrated, o.check, o.dry_run, o.force, o.device, progress, split=split,
               on_step=on_step)


def execute(run: Run) -> Run:
    """The steps in order; a dry run prints the plan and stops there. Thresholds are not enforced here."""
    run.bar = tqdm(total=len(STEPS), desc="quantize", unit="step", disable=not run.progress or run.dry_run)
    with run.bar:
        validate(run)
        plan(run)
        if run.dry_run:
            if run.kind != "none":       # a BF16 target: the split would be refused by the run, so by its plan too
                run.check_split(run.calibrate or run.check)
            offline.show_plan(run)
            return run
        prepare(run)
        with output(run):
            target(run)
            calibrate(run)
            convert(run)
            check(run)
            speed(run)
            report(run)
    return run


def enforce(run: Run) -> None:
    """Fail a finished run whose bitrates missed the recipe's thresholds (its report stays in OUT)."""
    if run.failures:
        raise ToolkitError(f"below the recipe's thresholds: {' | '.join(run.failures)} "
                           f"(report in {run.out / 'report.md'})")


def quantize(o: QuantizeOptions, progress: bool = True, on_step: Callable[[dict], None] | None = None) -> dict | int:
    """Convert a DFlash drafter to EXL3 at several bitrates with the options `o` (those of start); returns the
    report, or 0 for a dry run. Writes no model cards and pushes nothing (`o.push` is ignored here):
    toolkit.quantize composes those from hub/."""
    run = execute(start(o, progress, on_step))
    if run.dry_run:
        return 0
    enforce(run)
    return run.report


__all__ = ["QuantizeOptions", "Run", "enforce", "execute", "plan_json", "quantize", "start"]
