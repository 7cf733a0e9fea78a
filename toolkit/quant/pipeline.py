"""quantize(): validate, plan, calibrate, convert, check, report; the CLI and Python share this one signature."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..core.errors import ToolkitError
from . import calibrate as cal
from . import check as chk
from . import convert as conv
from . import report as rep
from .plan import format_plan, make_plan, plan_json
from .blocks import load_target, run_target
from .recipe import Recipe, load_recipe, parse_bits
from ..core.folders import read_config
from ..core.target import TargetInfo
from .source import resolve, target_kind
from .validate import linear_keys, unquantized_keys, validate

MANIFEST = ".quantize-run.json"
STEPS = ("validate", "plan", "calibrate", "convert", "check", "report")


@dataclass
class Settings:
    """The merged recipe + command line."""

    model: str
    model_id: str
    revision: str | None
    target: str | None
    target_revision: str | None
    bits: list[float]
    out: Path
    work_dir: Path
    recipe: Recipe = field(default_factory=lambda: Recipe(model=""))


def merge(recipe: str | None, model: str | None, revision: str | None, target: str | None, bits, out: str | None,
          work_dir: str | None) -> Settings:
    r = load_recipe(recipe) if recipe else None
    if not model and not r:
        raise ToolkitError("--model is required without --recipe")
    model = model or r.model
    from_recipe = r is not None and model == r.model
    model_id = r.model if r else model
    rev = revision or (r.revision if r and (from_recipe or Path(model).is_dir()) else None)
    tgt = target or (r.target if r else None)
    trev = r.target_revision if r and tgt == r.target else None
    b = parse_bits(bits) if bits else (r.bits if r else [4.0])
    o = Path(out) if out else Path("out") / (model_id.rstrip("/").split("/")[-1] + "-exl3")
    return Settings(model, model_id, rev, tgt, trev, b, o, Path(work_dir) if work_dir else o / ".work", r or Recipe(model=model))


def check_out_dir(out: Path, manifest: dict, force: bool) -> None:
    """A non-empty OUT must be an earlier run of the same model (resume), unless --force."""
    if force or not out.exists() or not any(out.iterdir()):
        return
    m = out / MANIFEST
    prev = None
    if m.is_file():
        try:
            prev = json.loads(m.read_text())
        except json.JSONDecodeError:
            prev = None
    if prev != manifest:
        raise ToolkitError(f"--out: {out} exists and is not a resumable run of {manifest['model']}; pass --force to overwrite it")


def encode_all(target, tokenizer, texts: list[str]) -> list[list[int]]:
    """Prompt ids through the target's chat template, as the runtime encodes them."""
    from ..runtime.torch_backend import TorchBackend

    b = TorchBackend(target, tokenizer)
    return [b.encode(t) for t in texts]


def quantize(recipe: str | None = None, model: str | None = None, revision: str | None = None, target: str | None = None,
             bits: str | list | None = None, out: str | None = None, work_dir: str | None = None, calibrate: bool = True,
             also_uncalibrated: bool = False, check: bool = True, dry_run: bool = False, force: bool = False,
             push: str | None = None, device: str | None = None, progress: bool = True) -> dict | int:
    """Convert a DFlash drafter to EXL3 at several bitrates; returns the report (or 0 for a dry run)."""
    s = merge(recipe, model, revision, target, bits, out, work_dir)
    steps = tqdm(total=len(STEPS), desc="quantize", unit="step", disable=not progress or dry_run)

    # 1. Validate
    steps.set_description("validate")
    mdir = resolve(s.model, s.revision, "model", config_only=dry_run, cache_only=dry_run)
    tcfg, notes = None, []
    if s.target:
        try:
            tdir = resolve(s.target, s.target_revision, "target", config_only=True, cache_only=dry_run)
            tcfg = read_config(tdir, "target")
        except ToolkitError:
            if not dry_run:
                raise
            notes.append(f"target {s.target} not checked: not a local folder and not in the Hub cache")
    checked = validate(mdir, tcfg, require_weights=not dry_run)
    config = checked.config
    s.recipe.check_expected(config)
    manifest = {"model": s.model_id, "revision": s.revision, "target": s.target}
    check_out_dir(s.out, manifest, force)
    steps.update()

    # 2. Plan
    steps.set_description("plan")
    items = make_plan(config, s.bits, s.out, s.model_id, s.revision, calibrate, also_uncalibrated, force)
    if dry_run:
        print(f"model {s.model_id} @ {s.revision or 'unpinned'} ({mdir}), target {s.target or 'none'}")
        print(f"drafter: {config.num_hidden_layers} layers, hidden {config.hidden_size}, block {config.block_size}, "
              f"taps {config.target_layer_ids}, layer types {sorted(set(config.layer_types))}")
        if not checked.has_weights:
            notes.append("no weights in the model folder: tensors not checked")
        print(format_plan(items, s.out))
        for n in notes:
            print(f"note: {n}")
        steps.close()
        return 0
    todo = [i for i in items if i.status != "done"]
    if todo and (why := conv.converter_unavailable()):
        raise ToolkitError(why)
    if (calibrate or check) and not s.target:
        raise ToolkitError("--target is needed to calibrate and check (or pass --no-calibrate --no-check)")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_model = tok = None
    if calibrate or check:
        tdir = resolve(s.target, s.target_revision, "target")
        if target_kind(read_config(tdir, "target")) == "exl3":
            raise ToolkitError(f"--target: {s.target} is EXL3; calibration and the check need its BF16 (transformers) weights")
        target_model, tok = load_target(tdir, dev)
    if force and s.out.exists():
        shutil.rmtree(s.out)
    s.out.mkdir(parents=True, exist_ok=True)
    conv.write_text(s.out / MANIFEST, json.dumps(manifest) + "\n")
    steps.update()

    from ..dflash import load_drafter
    reference = load_drafter(mdir, dtype=torch.float32, device=dev) if (calibrate or check) else None
    cal_texts, chk_texts = s.recipe.calibration_prompts, s.recipe.check_prompts
    if check and set(cal_texts) & set(chk_texts):
        raise ToolkitError("recipe: [check] prompts must be held out; some are also [calibration] prompts")

    # 3. Calibrate
    steps.set_description("calibrate")
    hess = s.work_dir / "hessians"
    if calibrate and any(i.calibrated for i in todo):
        cal.calibrate(reference, target_model, encode_all(target_model, tok, cal_texts), linear_keys(config),
                      s.recipe.anchors_per_prompt, hess, progress, continue_tokens=s.recipe.max_new_tokens)
    steps.update()

    # 4. Convert
    steps.set_description("convert")
    keep = unquantized_keys(config)
    for item in tqdm(todo, desc="convert", unit="bitrate", disable=not progress, leave=False):
        conv.convert_bitrate(item, mdir, s.out, s.work_dir, checked.tensors, keep, s.model_id, s.revision,
                             config.tap_shift, hess if item.calibrated else None, s.recipe.overrides, device)
        item.status = "done"
    steps.update()

    # 5. Check
    steps.set_description("check")
    tap_shift, bf16_tau, metrics, failures = config.tap_shift, None, {}, []
    if check:
        if not chk_texts:
            raise ToolkitError("recipe: no [check] prompts (or pass --no-check)")
        ids = encode_all(target_model, tok, chk_texts)
        shifts = [x for x in s.recipe.tap_shift_candidates if all(0 <= t + x < len_hidden(tcfg) for t in config.target_layer_ids)]
        prompts = [run_target(target_model, i, config, sorted(set(shifts) | {config.tap_shift}), s.recipe.max_new_tokens)
                   for i in ids]
        tap_shift, scores = chk.pick_tap_shift(reference, prompts, target_model, s.recipe.anchors_per_prompt, shifts)
        notes.append("tap_shift agreement with the target: " + ", ".join(f"{k}: {v:.3f}" for k, v in scores.items())
                     + f" -> {tap_shift}")
        bf16_tau = chk.measure_tau(target_model, tok, reference, ids, s.recipe.max_new_tokens, tap_shift)
        for item in tqdm(items, desc="check", unit="bitrate", disable=not progress, leave=False):
            qd = chk.load_quantized(s.out / item.folder, config, dev)
            m = chk.compare(reference, qd, prompts, target_model, s.recipe.anchors_per_prompt, tap_shift)
            m.tau = chk.measure_tau(target_model, tok, qd, ids, s.recipe.max_new_tokens, tap_shift)
            ok, why = chk.judge(m, s.recipe.thresholds_for(item.bits), bf16_tau)
            metrics[item.folder] = (m, ok)
            if not ok:
                failures.append(f"{item.folder}: " + "; ".join(why))
            conv.pin_tap_shift(s.out / item.folder, tap_shift)
            del qd
        notes.append("τ: greedy decoding through the torch runtime, EXL3 weights dequantized by exllamav3")
    steps.update()

    # 6. Report
    steps.set_description("report")
    results = [rep.result_row(i, conv.folder_size(s.out / i.folder), *(metrics.get(i.folder) or (None, None)))
               for i in items]
    dname = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    report = rep.build_report(s.model_id, s.revision, s.target, config.block_size, tap_shift, dname, bf16_tau,
                              checked.size_bytes, results)
    rep.write_report(s.out, report, notes)
    if (skipped := rep.write_cards(s.out, report)):
        print(f"warning: {skipped}")
    steps.update()
    steps.close()
    if failures:
        raise ToolkitError(f"below the recipe's thresholds: {' | '.join(failures)} (report in {s.out / 'report.md'})")
    if push:
        push_run(s.out, push)
    return report


def len_hidden(tcfg: dict | None) -> int:
    return TargetInfo(tcfg or {}).num_layers or 1 << 30   # tap L + shift must name one of the target's layers


def push_run(out: Path, repo: str) -> None:
    """Hand the finished run to the push step (its own issue)."""
    try:
        from ..hub.push import push as push_fn
    except ImportError:
        raise ToolkitError(f"--push {repo}: toolkit.push is not available yet; push {out} with it once it lands") from None
    push_fn(out_dir=str(out), repo=repo)


__all__ = ["quantize", "plan_json"]
