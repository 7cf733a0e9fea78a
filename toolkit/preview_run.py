"""`python -m toolkit.preview_run --out OUT`: a quantize run folder made on the CPU, to try the card and push first.

It runs the quantize pipeline over the shipped tiny pair (or `--pair smollm2`, the SmolLM2 demo pair, after
`python -m toolkit.demo prepare`): calibration and the KL, top-1 and τ check on the CPU, with a stand-in for
exllamav3's converter, which needs a GPU: each Linear rounded to a plain grid and stored in fp16. The folders are
not EXL3 (their config.json says so) and push uploads them only as a dry run. Then:
python -m toolkit.card --from OUT --repo YOU/NAME, and python -m toolkit.push --repo YOU/NAME --from OUT --dry-run.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from .core.cli import entry, option, run

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class PreviewOptions:
    out: str = option(help="the run folder to write (report.json, report.md, one folder per bitrate, the cards)")
    pair: str = option("tiny", "the shipped tiny pair, or the SmolLM2 demo pair (after python -m toolkit.demo prepare)",
                       choices=["tiny", "smollm2"])
    bits: str = option("3.0,4.0", "comma-separated bitrates, each 1-8")
    force: bool = option(False, "replace an existing --out once the new run is complete")


def preview_run(out: str, pair: str = "tiny", bits: str = "3.0,4.0", force: bool = False) -> Path:
    """The run folder `out`, quantized on the CPU with the stand-in converter; its cards written, thresholds not
    enforced (a preview fails nothing)."""
    from .core.folders import check_folder_place
    from .core.locks import hold
    from .hub.push import write_cards
    from .hub.upstream import copy_upstream
    from .quant.options import QuantizeOptions, settings
    from .quant.preview import cpu_converter, tiny_recipe

    check_folder_place(out)                    # before any work (the tiny pair may be built first)
    with ExitStack() as stack:
        stack.enter_context(hold(out, "preview_run"))                     # one run per OUT at a time
        if pair == "tiny":
            from .assets.pairs import tiny_pair

            target, model = tiny_pair()
            recipe = stack.enter_context(tiny_recipe(target))
        else:
            from .assets.smollm2 import default_pair

            target, model = default_pair()
            recipe = ROOT / "quantize" / "smollm2-135m-dflash.toml"
        o = QuantizeOptions(recipe=str(recipe), model=str(model), target=str(target), bits=bits, out=out, force=force,
                            device="cpu")
        s = settings(o)                        # the recipe and --bits, checked before the pipeline and torch load
        from .quant.pipeline import execute, start

        stack.enter_context(cpu_converter())
        run_ = execute(start(o, s=s))
        copy_upstream(run_.model_dir, run_.out)
        write_cards(run_.out)
    print(f"wrote {run_.out} (a CPU preview: not EXL3 weights). Read its card: python -m toolkit.card --from {run_.out} "
          f"--repo YOU/NAME; plan a push: python -m toolkit.push --repo YOU/NAME --from {run_.out} --dry-run")
    return run_.out


def main(argv: list[str] | None = None) -> Path:
    return run(preview_run, PreviewOptions, argv, "python -m toolkit.preview_run", __doc__.split("\n\n")[0].split(": ", 1)[1],
               output_policy=True)


if __name__ == "__main__":
    entry(main)
