"""The dry run without the network: plan from the recipe's shapes when a Hub model is not in the local cache, and
say what a real run will download and about how big it is.

A recipe's shapes are the config.json files under `quantize/shapes/`, one per Hub model, named after the repo
(`z-lab/Qwen3.6-35B-A3B-DFlash` -> `shapes/qwen3.6-35b-a3b-dflash.json`). A dry run that cannot read a model's
config from a local folder or the Hub cache reads its shapes instead, in a temporary config-only folder removed
at exit, and says so; sizes of what a real run fetches come from a cached safetensors index when there is one,
else from the shapes (BF16, and an EXL3 target's size at 4.0 bpw for a single GPU).
"""

from __future__ import annotations

import atexit
import json
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


def config_folder(cfg: dict) -> Path:
    """A temporary folder holding what a config-only fetch holds of a model: config.json, and a safetensors index
    whose total_size is the BF16 size of the shapes (the memory plan reads it), removed at exit."""
    folder = tempfile.mkdtemp(prefix="dflash-shapes-")
    if not _made:
        atexit.register(lambda: [shutil.rmtree(f, ignore_errors=True) for f in _made])
    _made.append(folder)
    (Path(folder) / "config.json").write_text(json.dumps(cfg))
    size = bf16_bytes(cfg)
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


def downloads(run) -> list[str]:
    """What a real run of this plan fetches from the Hub (nothing for local folders), with sizes."""
    from ..core.refs import parse_ref

    s, lines = run.s, []
    for what, ref, rev, folder in (("model", s.model, s.revision, run.model_dir), ("target", s.target, s.target_revision,
                                                                                  run.target_dir)):
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
            lines.append(f"    on one 24 GB GPU pass an EXL3 quant of it as --target instead: at {EXL3_BITS:.1f} bpw "
                         f"{size_text(exl3_bytes(cfg))} (a published quant, or exllamav3's converter: docs/quantize.md)")
    head = "a real run downloads (unless already in the Hub cache):"
    return [head, *lines] if lines else ["a real run downloads nothing: the model and target are local folders"]


def show_plan(run) -> None:
    """--dry-run: the drafter, the plan as a table, the GPU memory per step and the notes."""
    s, c = run.s, run.config
    where = "the recipe's shapes" if "model" in run.offline else run.model_dir
    print(f"model {s.model_id} @ {s.revision or 'unpinned'} ({where}), target {s.target or 'none'}"
          + (f" ({'EXL3 on exllamav3' if run.kind == 'exl3' else 'transformers'})" if run.kind != "none" else ""))
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
