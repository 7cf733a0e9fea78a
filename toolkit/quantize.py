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

import argparse

from .core.errors import OptionError, ToolkitError, run_cli
from .hub.push import push, write_cards
from .hub.upstream import copy_upstream
from .quant.pipeline import enforce, execute, start
from .runtime.gpu_split import add_split_args


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m toolkit.quantize", description=__doc__.split("\n\n")[0],
                                 epilog="Example (one GPU): python -m toolkit.quantize --recipe quantize/qwen3.6-35b-a3b-dflash.toml "
                                        "--target USER/Qwen3.6-35B-A3B-exl3@4.0bpw --dry-run")
    ap.add_argument("--recipe", help="recipe TOML under quantize/ (model, revision, target, bits, prompts, thresholds)")
    ap.add_argument("--model", help="drafter: local folder or Hub ref USER/NAME[@REVISION] (default: the recipe's)")
    ap.add_argument("--revision", help="Hub revision of --model (default: the recipe's pinned one, or the one after @)")
    ap.add_argument("--target", help="target: local folder or Hub ref USER/NAME[@REVISION] of an EXL3 target (one GPU: "
                                     "e.g. USER/Qwen3.6-35B-A3B-exl3@4.0bpw, runs on exllamav3) or a BF16 one "
                                     "(transformers) (default: the recipe's)")
    ap.add_argument("--bits", help="comma-separated bitrates, each 1-8 with at most two decimals, e.g. 3.0,4.0,5.0,6.0,8.0")
    ap.add_argument("--out", help="output folder (default out/<model name>-exl3): report.* and one folder per bitrate")
    ap.add_argument("--work-dir", help="scratch folder for Hessians and converter jobs (default OUT/.work)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="calibrate with the target's hidden states (default on); --no-calibrate converts uncalibrated")
    ap.add_argument("--also-uncalibrated", action="store_true",
                    help="with --calibrate, also convert uncalibrated into <bits>bpw-uncal folders for comparison (not pushed)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="compare each bitrate with the BF16 reference (KL, top-1; with an EXL3 target also tau and "
                         "tok/s against AR on exllamav3) and enforce the recipe's thresholds (default on)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan and the GPU memory of each step, and exit; touches no GPU and no network")
    ap.add_argument("--force", action="store_true", help="overwrite an existing output folder and redo every bitrate")
    ap.add_argument("--push", metavar="REPO", help="after a passing run, push the outputs to this Hub repo (toolkit.push)")
    ap.add_argument("--device", help="device: cuda, cuda:N or N for conversion, calibration and checks (default cuda); cpu runs calibration and checks on the CPU")
    add_split_args(ap.add_argument_group("EXL3 target on several GPUs (its target and speed steps)"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    repo = args.pop("push")
    try:
        run = execute(start(**args))  # the library: OUT's bitrate folders and report, thresholds not yet enforced
    except OptionError as e:
        raise ToolkitError(f"--{e.field.replace('_', '-')}{e.rest}") from None
    if run.dry_run:
        return 0
    copy_upstream(run.model_dir, run.out)   # the drafter's own card and license, credited by the model cards
    write_cards(run.out)              # publishing (hub/): a model card per bitrate folder, also for a failing run
    enforce(run)                      # below the recipe's thresholds: one error line, nothing pushed
    if repo:
        push(repo=repo, out_dir=run.out)
    return 0


if __name__ == "__main__":
    run_cli(lambda: main())
