"""What kind of model folder a path holds, so that a folder given to the wrong flag is named for what it is.

Three kinds meet in this toolkit: an unquantized transformers model (a target), a DFlash drafter in the upstream
layout, and an EXL3 checkpoint of either. Each loader asks `require(folder, want, what)` before it loads anything,
so an EXL3 folder given to the torch backend or a drafter given as --target is one line saying which kind it is,
not a model with random weights or a failure much later.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ToolkitError
from .target import TargetInfo

DRAFTER = "DFlashDraftModel"     # the upstream drafter's architecture (dflash.config.ARCHITECTURE)
HF, DFLASH = "hf", "dflash"      # the kinds a loader asks for
EXL3_SUFFIXES = (".trellis", ".suh", ".svh", ".mcg", ".mul1")   # tensor names only an EXL3 linear has


def kind_of(info: TargetInfo) -> str:
    """The folder's kind in words: "an EXL3 checkpoint", "a DFlash drafter", "an HF model (LlamaForCausalLM)"..."""
    drafter = DRAFTER in info.architectures
    if info.exl3:
        return "an EXL3 checkpoint of a DFlash drafter" if drafter else "an EXL3 checkpoint"
    if drafter:
        return "a DFlash drafter"
    return f"an HF model ({info.architecture or info.model_type or 'no architectures in config.json'})"


def require(folder: str | Path, want: str, what: str, info: TargetInfo | None = None) -> TargetInfo:
    """Read `folder`'s config (unless `info` is it) and refuse it unless it is an unquantized model of kind `want`
    (HF or DFLASH).

    `what` starts the error line (e.g. "--target"); the line names the kind found and what the flag needs."""
    info = info or TargetInfo.read(folder, what.lstrip("-") or None)
    if info.exl3:
        need = "the unquantized drafter" if want == DFLASH else "an unquantized HF model (EXL3 runs on --backend exllamav3)"
        raise ToolkitError(f"{what}: {folder} is {kind_of(info)}; the torch backend needs {need}")
    return check_role(folder, want, what, info)


def check_role(folder: str | Path, want: str, what: str, info: TargetInfo | None = None) -> TargetInfo:
    """Refuse a folder that is not a model of kind `want`, unquantized or EXL3: a target (HF) is a model and not a
    drafter, a drafter (DFLASH) is one. No config.json, or one naming no architecture, is not a model folder."""
    info = info or TargetInfo.read(folder, what.lstrip("-") or None)
    is_drafter = DRAFTER in info.architectures
    if want == HF and is_drafter:
        raise ToolkitError(f"{what}: {folder} is {kind_of(info)}, not a target model (a drafter goes to --draft)")
    if want == DFLASH and not is_drafter:
        raise ToolkitError(f"{what}: {folder} is {kind_of(info)}, not a DFlash drafter "
                           f"(architectures {info.architectures!r}, expected [{DRAFTER!r}]; a target goes to --target)")
    if not (info.architecture or info.model_type):
        raise ToolkitError(f"{what}: {folder}/config.json names no architectures or model_type: not a model folder")
    return info


def exl3_tensor(name: str) -> bool:
    """A tensor name that only an EXL3 checkpoint has (a quantized linear's trellis or scales)."""
    return name.endswith(EXL3_SUFFIXES)


def check_loading(report: dict, folder: str | Path, what: str, tied: bool) -> None:
    """Refuse what transformers' loading report (`output_loading_info=True`) lists: a missing, unexpected or
    misshaped tensor is one line naming it. A tied lm_head (`tie_word_embeddings`) has no weight of its own."""
    missing = sorted(k for k in report.get("missing_keys") or () if not (tied and k.endswith("lm_head.weight")))
    unexpected = sorted(report.get("unexpected_keys") or ())
    mismatched = sorted(report.get("mismatched_keys") or ())
    more = lambda keys: f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""   # noqa: E731
    if any(exl3_tensor(k) for k in unexpected):
        raise ToolkitError(f"{what}: {folder} holds EXL3 tensors ({next(k for k in unexpected if exl3_tensor(k))!r}); "
                           "the torch backend needs an unquantized HF model")
    if missing:
        raise ToolkitError(f"{what}: {folder} lacks tensor {missing[0]!r}{more(missing)}; refusing to run it with random weights")
    if mismatched:
        name, have, want = mismatched[0]
        raise ToolkitError(f"{what}: {folder}: tensor {name!r} has shape {tuple(have)}, the config needs {tuple(want)}"
                           f"{more(mismatched)}")
    if unexpected:
        raise ToolkitError(f"{what}: {folder} has tensor {unexpected[0]!r}{more(unexpected)}, which the model "
                           "does not use (another architecture or a mislabelled folder?)")
    errors = report.get("error_msgs") or []
    if errors:
        raise ToolkitError(f"{what}: {folder}: {str(errors[0]).splitlines()[0]}")
