"""The transformers loaders: a target model and its tokenizer from a local folder, strict and in one-line errors.
The torch backend, the trainer and the quantize pipeline load through them; the exllamav3 backend reads only the
target's tokenizer here."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from ..dflash.loading import check_finite_model


def load_hf_model(folder: str | Path, device: str = "cpu", dtype="auto", what: str = "--target", info=None):
    """A transformers causal LM from a local folder, on `device`, in eval mode with its weights frozen.

    Strict: an EXL3 checkpoint or a DFlash drafter is refused by its kind, every safetensors header is checked
    against its file (truncation), and any tensor transformers' loading report lists as missing, unexpected or
    misshaped is one line naming it: never a model running on randomly initialised weights."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from ..core.kinds import HF, check_loading, require
    from ..core.tensorfiles import check_folder

    require(folder, HF, what, info)                 # `info`: the folder's TargetInfo, when already read
    check_folder(folder, what)
    try:
        model, report = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True,
                                                            ignore_mismatched_sizes=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolkitError(f"{what}: cannot load {folder} with transformers ({reason})") from None
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    check_loading(report, folder, what, tied)
    check_finite_model(model, f"{what}: {folder}")
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError, ValueError) as e:       # no CUDA build, no such GPU, a bad device string
        raise ToolkitError(f"--device {device}: cannot place the model there ({str(e).splitlines()[0]})") from None
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_hf_tokenizer(folder: str | Path, what: str = "--target"):
    """The folder's transformers tokenizer; a folder without one, or a broken one, is one line."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ToolkitError(f"{what}: cannot load the tokenizer of {folder} ({reason})") from None
