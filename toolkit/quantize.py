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

from collections.abc import Callable
from contextlib import nullcontext

from .core.cli import entry, run
from .core.folders import claim
from .core.locks import hold
from .quant.options import QuantizeOptions, settings

EXAMPLE = ("Example (one GPU): python -m toolkit.quantize --recipe quantize/qwen3.6-35b-a3b-dflash.toml "
           "--target USER/Qwen3.6-35B-A3B-exl3@4.0bpw --dry-run")


def quantize(o: QuantizeOptions, on_step: Callable[[dict], None] | None = None) -> int:
    """The pipeline (`start(o)`: the library), then publishing; `o.push` is the Hub repo of a passing run,
    `on_step` gets each step's timing row as it ends (not a flag: for callers such as the device scripts)."""
    s = settings(o)                           # the recipe and the flags: a bad one is refused before torch loads
    claim(s.out, "quantize", True)            # OUT a file, under a file, unwritable: refused before any work
    from .hub.push import PushOptions, write_cards  # here, not at the top: --help loads neither torch nor the Hub client
    from .hub.push import push as push_to_hub
    from .hub.upstream import copy_upstream
    from .quant.pipeline import enforce, execute, start

    run = start(o, on_step=on_step, s=s)
    with nullcontext() if run.dry_run else hold(run.s.out, "quantize"):     # one run per OUT at a time
        run = execute(run)                    # OUT's bitrate folders and report, thresholds not yet enforced
        if run.dry_run:
            return 0
        copy_upstream(run.model_dir, run.out)     # the drafter's own card and license, credited by the model cards
        write_cards(run.out)                  # publishing (hub/): a model card per bitrate folder, also for a failing run
        enforce(run)                          # below the recipe's thresholds: one error line, nothing pushed
        if o.push:
            push_to_hub(PushOptions(repo=o.push, out_dir=str(run.out)))
    return 0


def main(argv: list[str] | None = None, on_step: Callable[[dict], None] | None = None) -> int:
    return run(lambda **kw: quantize(QuantizeOptions(**kw), on_step), QuantizeOptions, argv, "python -m toolkit.quantize",
               __doc__.split("\n\n")[0], EXAMPLE, output_policy=True)


if __name__ == "__main__":
    entry(main)
