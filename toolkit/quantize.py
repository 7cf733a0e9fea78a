"""`python -m toolkit.quantize`: convert a DFlash drafter to EXL3 at several bitrates, calibrated, checked, reported.

Steps: validate the checkpoint against the target, plan one output folder per bitrate (finished ones are
skipped on a rerun, half-written ones redone) with the GPU memory of each step, run the target over the prompts
(an EXL3 target on exllamav3, then unloaded), accumulate input Hessians from its hidden states, convert each
bitrate with exllamav3 in a subprocess, compare every EXL3 drafter with the BF16 reference on held-out prompts
(KL, top-1; tap_shift verified), measure τ and tok/s against AR per bitrate on exllamav3 with an EXL3 target
(τ through the torch runtime with a BF16 one), and write report.json / report.md / tau_top1.png. Then the
publishing, from hub/: the upstream README.md and LICENSE* into OUT/upstream, a model card per folder, and with
--push the upload of a passing run. Flags override the recipe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from .core.cli import entry, option, run
from .core.folders import claim
from .core.locks import hold
from .runtime.placement import DRAFT_HELP, SPLIT_HELP, TP_HELP

SPLIT_GROUP = "EXL3 target on several GPUs (its target and speed steps)"
EXAMPLE = ("Example (one GPU): python -m toolkit.quantize --recipe quantize/qwen3.6-35b-a3b-dflash.toml "
           "--target USER/Qwen3.6-35B-A3B-exl3@4.0bpw --dry-run")


@dataclass
class QuantizeOptions:
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


def quantize(push: str | None = None, on_step: Callable[[dict], None] | None = None, **args) -> int:
    """The pipeline (`start(**args)`: the library), then publishing; `push` is the Hub repo of a passing run,
    `on_step` gets each step's timing row as it ends (not a flag: for callers such as the device scripts)."""
    from .hub.push import push as push_to_hub      # here, not at the top: --help loads neither torch nor the Hub client
    from .hub.push import write_cards
    from .hub.upstream import copy_upstream
    from .quant.pipeline import enforce, execute, start

    run = start(on_step=on_step, **args)
    claim(run.s.out, "quantize", True)        # OUT a file, under a file, unwritable: refused before any work
    with nullcontext() if run.dry_run else hold(run.s.out, "quantize"):     # one run per OUT at a time
        run = execute(run)                    # OUT's bitrate folders and report, thresholds not yet enforced
        if run.dry_run:
            return 0
        copy_upstream(run.model_dir, run.out)     # the drafter's own card and license, credited by the model cards
        write_cards(run.out)                  # publishing (hub/): a model card per bitrate folder, also for a failing run
        enforce(run)                          # below the recipe's thresholds: one error line, nothing pushed
        if push:
            push_to_hub(repo=push, out_dir=run.out)
    return 0


def main(argv: list[str] | None = None, on_step: Callable[[dict], None] | None = None) -> int:
    fn = functools.partial(quantize, on_step=on_step) if on_step else quantize
    return run(fn, QuantizeOptions, argv, "python -m toolkit.quantize", __doc__.split("\n\n")[0], EXAMPLE,
               output_policy=True)


if __name__ == "__main__":
    entry(main)
