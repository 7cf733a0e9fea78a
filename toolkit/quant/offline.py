"""The dry run without the network: plan from the recipe's shapes when a Hub model is not in the local cache, and
say what a real run will download and about how big it is.

A recipe's shapes are the config.json files under `quantize/shapes/`, one per Hub model, named after the repo
(`z-lab/Qwen3.6-35B-A3B-DFlash` -> `shapes/qwen3.6-35b-a3b-dflash.json`). A dry run that cannot read a model's
config from a local folder or the Hub cache reads its shapes instead, in a temporary config-only folder removed
at exit, and says so; sizes of what a real run fetches come from a cached safetensors index when there is one,
else from the shapes (BF16, and an EXL3 target's size at 4.0 bpw for a single GPU). A target that is neither on
disk nor cached (an EXL3 quant not made or downloaded yet) is planned as the recipe's [target] shape, as an EXL3
quant at the bitrate its name says (`...-exl3-4.0bpw`, `@4.0bpw`) when it names one, else BF16 for a Hub id and
EXL3 at 4.0 bpw (the one-GPU path) for a name that is neither a folder nor a Hub id, each labelled as assumed:
every step of the run is planned, and the plan says what must be made or downloaded first. A target folder that
holds only its config is planned from that config.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from pathlib import Path

from ..core import files
from ..core.errors import ToolkitError
from ..core.tensorfiles import index_size
from . import memory as mem
from .memory import GIB
from .plan import format_plan
from .source import fetch_ref

SHAPES = "shapes"
EXL3_BITS = 4.0          # the bitrate the one-GPU hint sizes an EXL3 target at
_made: list[str] = []     # temporary config-only folders, removed at exit


def shapes_file(recipe, ref: str) -> Path | None:
    """The recipe's shapes file of a Hub ref (`USER/NAME[@REV]`), or None without one."""
    if recipe is None or recipe.path is None:
        return None
    name = ref.partition("@")[0].rstrip("/").split("/")[-1].lower()
    path = Path(recipe.path).parent / SHAPES / f"{name}.json"
    return path if path.is_file() else None


def read_shapes(path: Path) -> dict:
    """A shapes file as a config (its `_source` and other `_` keys dropped)."""
    cfg = files.read_object(path, "recipe shapes")
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def config_folder(cfg: dict, size: int | None = None) -> Path:
    """A temporary folder holding what a config-only fetch holds of a model: config.json, and a safetensors index
    whose total_size is `size` (default: the BF16 size of the shapes; the memory plan reads it), removed at exit."""
    folder = tempfile.mkdtemp(prefix="dflash-shapes-")
    if not _made:
        atexit.register(lambda: [shutil.rmtree(f, ignore_errors=True) for f in _made])
    _made.append(folder)
    (Path(folder) / "config.json").write_text(json.dumps(cfg))
    size = bf16_bytes(cfg) if size is None else size
    if size is not None:
        index = {"metadata": {"total_size": size, "estimated_from": "recipe shapes"}, "weight_map": {}}
        (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index))
    return Path(folder)


def fetch_or_shapes(run, ref: str, revision: str | None, what: str, config_only: bool) -> tuple[Path, str | None]:
    """fetch_ref; in a dry run, a Hub ref not in the local cache is planned from the recipe's shapes instead."""
    try:
        return fetch_ref(ref, revision, what, config_only=config_only, cache_only=run.dry_run)
    except ToolkitError:
        shapes = shapes_file(run.s.recipe, ref) if run.dry_run else None
        if shapes is None:
            raise
    run.notes.append(f"{what} {ref} is not in the local Hub cache: planned from the recipe's shapes "
                     f"({shapes.parent.name}/{shapes.name}, not read from the Hub)")
    run.offline[what] = read_shapes(shapes)
    return config_folder(run.offline[what]), None


BPW = re.compile(r"(?<![\d.])([1-8](?:\.\d{1,2})?)[-_ ]?bpw", re.IGNORECASE)


def named_bits(ref: str) -> float | None:
    """The EXL3 bitrate a model's name or branch says (`...-exl3-4.0bpw`, `@4.0bpw`; EXL3_BITS for a name that says
    exl3 without one), or None when the name does not say EXL3."""
    m = BPW.search(ref)
    if m:
        return float(m.group(1))
    return EXL3_BITS if "exl3" in ref.lower() else None


def planned_target(run, ref: str) -> tuple[Path, None] | None:
    """A dry run's target that is neither on disk nor in the Hub cache, planned as the recipe's [target] shape: EXL3
    at the bitrate its name says; else BF16 for a Hub id (USER/NAME), and for a name that is neither a folder here
    nor a Hub id (`--target TARGET` as a placeholder) the recipe's EXL3 target at EXL3_BITS, the one-GPU path; each
    labelled as such (None without the recipe's shapes). run.offline["target_plan"] keeps what the plan assumed."""
    recipe = run.s.recipe
    base = recipe.target if recipe is not None else None
    shapes = shapes_file(recipe, base) if base else None
    if shapes is None:
        return None
    cfg, named, hub = read_shapes(shapes), named_bits(ref), is_hub_name(ref)
    bits = named or (None if hub else EXL3_BITS)
    size = exl3_bytes(cfg, bits) if bits else bf16_bytes(cfg)
    if bits:
        cfg = {**cfg, "quantization_config": {"quant_method": "exl3", "bits": bits}}
    run.offline["target"] = cfg
    run.offline["target_plan"] = {"base": base, "bits": bits, "bytes": size, "hub": hub, "named": named is not None,
                                  "base_bytes": bf16_bytes(read_shapes(shapes))}
    kind = (f"an EXL3 quant at {bits:.1f} bpw (from its name)" if named else
            f"an EXL3 quant at {bits:.1f} bpw (assumed: the one-GPU path)" if bits else "a BF16 checkpoint")
    where = "is not on disk and not in the Hub cache" if hub else "is neither a folder here nor a Hub id (USER/NAME)"
    run.notes.append(f"target {ref} {where}: planned as {kind} of {base}, from the recipe's shapes "
                     f"({shapes.parent.name}/{shapes.name}), {size_text(size)}")
    return config_folder(cfg, size), None


def target_weights(run, folder: Path | None, cfg: dict) -> int | None:
    """GPU bytes of the target's weights (memory.py), from its config when its folder holds none (noted once)."""
    if folder is None or run.kind not in ("exl3", "hf"):
        return None
    got = (mem.exl3_weights if run.kind == "exl3" else mem.hf_weights)(folder, cfg)
    if got is not None:
        return got
    got = config_weights(cfg, run.kind)
    note = (f"the target's folder holds no weights: they are planned from its config.json, {size_text(got)}"
            if got is not None else "the target's folder holds no weights and its config's family is not one the "
            "plan can size")
    if note not in run.notes:
        run.notes.append(note)
    return got


def config_weights(cfg: dict, kind: str) -> int | None:
    """GPU bytes of a target's weights from its config alone (a folder that holds only config.json), as the memory
    plan counts them: an EXL3 target at its config's bitrate without the embedding table exllamav3 keeps on the
    CPU; a transformers target in bf16, float32 below 2B parameters. None for a family the layout does not know."""
    from ..core.target import TargetInfo

    if kind == "exl3":
        bits = ((cfg.get("quantization_config") or {}).get("bits")) or EXL3_BITS
        size = exl3_bytes(cfg, float(bits))
        info = TargetInfo(cfg)
        return None if size is None else max(0, size - 2 * (info.vocab_size or 0) * (info.hidden_size or 0))
    size = bf16_bytes(cfg)
    if size is None:
        return None
    params = size // 2
    return params * (4 if params < 2_000_000_000 else 2)


def is_hub_name(ref: str) -> bool:
    """Whether a real run would fetch `ref` from the Hub as named: USER/NAME[@REVISION]."""
    return ref.partition("@")[0].count("/") == 1 and not ref.startswith(("/", ".", "~"))


def bf16_bytes(cfg: dict) -> int | None:
    """BF16 bytes of a config's weights (its quantizable linears in full), from toolkit.synthetic's layout."""
    plan = layout(cfg, 4)
    if plan is None:
        return None
    total = 0
    for t in plan.tensors:
        if t.fill == "trellis":                         # [in/16, out/16, 16*K] -> in x out weights
            total += t.shape[0] * 16 * t.shape[1] * 16 * 2
        elif t.fill not in ("suh", "svh", "marker"):
            total += t.nbytes
    return total


def exl3_bytes(cfg: dict, bits: float = EXL3_BITS) -> int | None:
    plan = layout(cfg, int(bits))
    return plan.nbytes if plan is not None else None


def layout(cfg: dict, bits: int):
    from ..synthetic.layout import build_plan

    try:
        return build_plan(cfg, bits)
    except ToolkitError:                                # a family the synthetic layout does not know
        return None


def index_bytes(folder: Path | None) -> int | None:
    """total_size of a (cached, config-only) safetensors index."""
    return index_size(folder)


def size_text(n: int | None) -> str:
    return "size unknown" if n is None else f"about {n / GIB:.1f} GiB" if n >= GIB / 10 else f"about {n / 2**20:.0f} MiB"


def missing_target(run) -> list[str]:
    """What must exist before a real run, for a target the plan did not find: a Hub quant it downloads, or a folder
    to make first (downloading the BF16 model, then exllamav3's converter)."""
    plan, ref = run.offline["target_plan"], run.s.target
    why = "from its name" if plan["named"] else "assumed"
    what = f"EXL3 at {plan['bits']:.1f} bpw ({why})" if plan["bits"] else "BF16 (transformers)"
    head = f"  {ref}: the target, {what}, {size_text(plan['bytes'])}"
    hint = [exl3_hint(run.offline["target"])] if not plan["bits"] and (plan["bytes"] or 0) > 20 * GIB else []
    if plan["hub"]:
        return [head, *hint]
    base = plan["base"]
    local = base.split("/")[-1] if plan["bits"] else ref
    lines = [head + ": not on disk yet; make it first (a real run stops at a name that is neither a folder nor a Hub id):",
             f"    hf download {base} --local-dir {local}      (BF16, {size_text(plan['base_bytes'])})"]
    if plan["bits"]:
        lines += [f"    python -m exllamav3.conversion.convert_model -i {local} -o {ref} -w exl3-work -b {plan['bits']:.1f}",
                  "    or pass a published EXL3 quant: --target USER/NAME@REVISION (docs/quantize.md)"]
    return lines + hint


def exl3_hint(cfg: dict) -> str:
    """The line for a BF16 target too big for one 24 GB card."""
    return (f"    on one 24 GB GPU pass an EXL3 quant of it as --target instead: at {EXL3_BITS:.1f} bpw "
            f"{size_text(exl3_bytes(cfg))} (a published quant, or exllamav3's converter: docs/quantize.md)")


def downloads(run) -> list[str]:
    """What a real run of this plan fetches from the Hub (nothing for local folders), with sizes."""
    from ..core.refs import parse_ref

    s, lines = run.s, []
    for what, ref, rev, folder in (("model", s.model, s.revision, run.model_dir), ("target", s.target, s.target_revision,
                                                                                  run.target_dir)):
        if what == "target" and "target_plan" in run.offline:
            lines += missing_target(run)
            continue
        if not ref or parse_ref(ref, what).is_local:
            continue
        cfg = run.offline.get(what) or (run.target_config if what == "target" else None) or {}
        size = index_bytes(folder) or (bf16_bytes(cfg) if cfg else None)
        if what == "model":
            lines.append(f"  {ref}@{rev or 'main'}: the drafter's weights, {size_text(size)}")
            continue
        uses = run.calibrate or run.check
        kind = "EXL3" if run.kind == "exl3" else "BF16 (transformers)"
        lines.append(f"  {ref}{'@' + rev if rev else ''}: the target, {kind}, "
                     + (f"{size_text(size)}" if uses else "config and tokenizer only (no --calibrate/--check)"))
        if uses and run.kind != "exl3" and cfg and (size or 0) > 20 * GIB:
            lines.append(exl3_hint(cfg))
    head = "a real run downloads (unless already in the Hub cache):"
    return [head, *lines] if lines else ["a real run downloads nothing: the model and target are local folders"]


def show_plan(run) -> None:
    """--dry-run: the drafter, the plan as a table, the GPU memory per step and the notes."""
    s, c = run.s, run.config
    where = "the recipe's shapes" if "model" in run.offline else run.model_dir
    planned = ", not here yet: planned from the recipe's shapes" if "target_plan" in run.offline else ""
    print(f"model {s.model_id} @ {s.revision or 'unpinned'} ({where}), target {s.target or 'none'}"
          + (f" ({'EXL3 on exllamav3' if run.kind == 'exl3' else 'transformers'}{planned})" if run.kind != "none" else ""))
    print(f"drafter: {c.num_hidden_layers} layers, hidden {c.hidden_size}, block {c.block_size}, "
          f"taps {c.target_layer_ids}, layer types {sorted(set(c.layer_types))}")
    if not run.checked.has_weights:
        run.notes.append("no weights in the model folder: tensors not checked")
    print(format_plan(run.items, s.out))
    print(mem.format_memory(run.needs, run.kind == "none" or run.target_weights is not None))
    if not run.split.default and run.kind == "exl3":
        print(f"EXL3 target placement: {run.split.tag} (each device is checked when the target loads)")
    elif not run.split.default:
        run.notes.append(f"{run.split.tag} places an EXL3 target; the target was not checked, so it may not apply")
    print("\n".join(downloads(run)))
    for n in run.notes:
        print(f"note: {n}")
