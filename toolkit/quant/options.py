"""The options of a quantize run, one source for `python -m toolkit.quantize` and the pipeline (`start`,
`quantize`): each option's help, default and domain beside its name. Imports without torch, so `--help` answers
at once."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.cli import option
from ..runtime.placement import DRAFT_HELP, SPLIT_HELP, TP_HELP
from .recipe import Settings, merge

SPLIT_GROUP = "EXL3 target on several GPUs (its target and speed steps)"


@dataclass
class QuantizeOptions:
    """Flags win over the recipe; an option left None takes the recipe's value. `push` is the command's publishing
    step (toolkit.quantize): the pipeline itself pushes nothing."""

    recipe: str | None = option(None, "recipe TOML under quantize/ (model, revision, target, bits, prompts, thresholds)")
    model: str | None = option(None, "drafter: local folder or Hub ref USER/NAME[@REVISION] (default: the recipe's)")
    revision: str | None = option(None, "Hub revision of --model (default: the recipe's pinned one, or the one after @)")
    target: str | None = option(None, "target: local folder or Hub ref USER/NAME[@REVISION] of an EXL3 target (one GPU: "
                                "e.g. USER/Qwen3.6-35B-A3B-exl3@4.0bpw, runs on exllamav3) or a BF16 one "
                                "(transformers) (default: the recipe's)")
    target_model: str | None = option(None, "the Hub model the drafter serves, USER/NAME, as the model cards name it "
                                      "(default: the recipe's [target] id)", metavar="USER/NAME")
    bits: str | None = option(None, "comma-separated bitrates, each 1-8 with at most two decimals, e.g. 3.0,4.0,5.0,6.0,8.0")
    out: str | None = option(None, "output folder (default out/<model name>-exl3): report.* and one folder per bitrate")
    work_dir: str | None = option(None, "scratch folder for Hessians and converter jobs (default OUT/.work)")
    calibrate: bool = option(True, "calibrate with the target's hidden states (default on); --no-calibrate converts "
                             "uncalibrated")
    also_uncalibrated: bool = option(False, "with --calibrate, also convert uncalibrated into <bits>bpw-uncal folders "
                                     "for comparison (not pushed)")
    check: bool = option(True, "compare each bitrate with the BF16 reference (KL, top-1; with an EXL3 target also tau "
                         "and tok/s against AR on exllamav3) and enforce the recipe's thresholds (default on)")
    dry_run: bool = option(False, "print the plan and the GPU memory of each step, and exit; touches no GPU and no network")
    force: bool = option(False, "overwrite an existing output folder and redo every bitrate")
    push: str | None = option(None, "after a passing run, push the outputs to this Hub repo (toolkit.push)", metavar="REPO")
    device: str | None = option(None, "device: cuda, cuda:N or N for conversion, calibration and checks (default cuda); "
                                "cpu runs calibration and checks on the CPU", kind="device_index")
    gpu_split: str | None = option(None, SPLIT_HELP, metavar="auto|GB,GB,...", group=SPLIT_GROUP)
    tensor_parallel: bool = option(False, TP_HELP, group=SPLIT_GROUP)
    draft_device: int = option(0, DRAFT_HELP, metavar="N", group=SPLIT_GROUP, lo=0, hi=1023)


def settings(o: QuantizeOptions) -> Settings:
    """The run's settings: the recipe `o` names, read and checked, with the flags over it (recipe.merge). Without
    torch, so a bad recipe or flag is one line before the pipeline loads."""
    return merge(o.recipe, o.model, o.revision, o.target, o.bits, o.out, o.work_dir, o.target_model)
