"""τ and speed of each drafter on exllamav3 with the EXL3 target: the numbers the users of the quants get.

The target is loaded once, with the first drafter, through the exllamav3 backend (engine.ENGINE); every other
drafter is swapped into that backend (engine.ENGINE.swap_draft: the old drafter unloaded, the new one loaded
beside the same target, cache and placement), so a run of five bitrates pays one target load, not six. The
held-out prompts are decoded one after another (one user's stream) greedily at each asked draft width
(GenSettings with a fixed block of width + 1). Plain AR on the same target runs once, right after the load, and
is the baseline of every drafter (same process, same target load and cache). Per width: τ (mean accepted + 1
per verification round), acceptance per draft position, tok/s of both, the speedup, and the share of prompts
whose output equals AR's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.backend import Backend, GenSettings
from ..runtime.events import Round, summarize, tokens_of

WARMUP_TOKENS = 8


@dataclass
class SpeedSetup:
    """What every measurement of one run shares."""

    target: Path                 # the EXL3 target folder
    name: str                    # the target as the user named it (a Hub ref or a folder), for the report and card
    bits: float | None           # the target's bitrate (its quantization_config)
    prompts: list[list[int]]     # the held-out check prompts, tokenized
    max_new_tokens: int
    cache_tokens: int
    split_kw: dict = field(default_factory=dict)   # {"split": GpuSplit} when the target is not on GPU 0 alone


def decode(backend: Backend, prompts: list[list[int]], settings: GenSettings,
           speculative: bool) -> tuple[list[list[Round]], float]:
    """Each prompt on its own, after a short warm-up of the same setting; (rounds per prompt, seconds)."""
    warm = GenSettings(**{**vars(settings), "max_new_tokens": min(WARMUP_TOKENS, settings.max_new_tokens)})
    list(backend.generate_many([prompts[0]], warm, speculative=speculative))
    rounds: list[list[Round]] = []
    t0 = time.perf_counter()
    for p in prompts:
        rounds.append([r for _, r in backend.generate_many([p], settings, speculative=speculative)])
    return rounds, time.perf_counter() - t0


@dataclass
class Baseline:
    """Plain AR decoding of the prompts on the target: its tok/s and its tokens (what lossless decoding must emit)."""

    tok_s: float
    tokens: list[list[int]]


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first token index where two outputs part (the shorter length if one is a prefix); None if equal."""
    if got == want:
        return None
    return next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))


def cell(rounds: list[list[Round]], secs: float, ar: Baseline, width: int, setup: SpeedSetup) -> dict:
    """The report's `exl3` object for one drafter at one width; `first_diff` per prompt says where an output left
    AR's (None where it did not), so a near-tie late in an answer reads apart from a broken verify."""
    s = summarize([r for job in rounds for r in job], secs)
    diff = [first_difference(tokens_of(job), a) for job, a in zip(rounds, ar.tokens)]
    same = [d is None for d in diff]
    return {"tau": s.tau, "accept_per_position": s.accept_per_position, "tok_s": s.tok_s, "ar_tok_s": ar.tok_s,
            "speedup": s.tok_s / ar.tok_s if ar.tok_s else None, "lossless": sum(same) / len(same), "first_diff": diff,
            "draft_tokens": width, "target": setup.name, "target_bits": setup.bits, "tokens": s.tokens,
            "seconds": round(secs, 3)}


@contextmanager
def loaded(engine, setup: SpeedSetup, draft: Path) -> Iterator[Backend]:
    """The target with `draft` on the engine (one job at a time), closed and its GPU memory freed at the end."""
    be = engine.open_backend(setup.target, draft, setup.cache_tokens, 1, **setup.split_kw)
    try:
        yield be
    finally:
        be.close()
        from ..exl3.taps import free_gpu

        free_gpu()


def settings(setup: SpeedSetup, width: int = 0) -> GenSettings:
    """Greedy decoding of max_new_tokens; a fixed block of width + 1 (0: no block, the AR baseline)."""
    return GenSettings(max_new_tokens=setup.max_new_tokens, temperature=0.0, block_size=width + 1 if width else None)


def baseline(be: Backend, setup: SpeedSetup) -> Baseline:
    """Plain AR over the prompts on the loaded target: the baseline of every drafter measured in this load."""
    rounds, secs = decode(be, setup.prompts, settings(setup), speculative=False)
    return Baseline(summarize([r for job in rounds for r in job], secs).tok_s, [tokens_of(job) for job in rounds])


def measure(be: Backend, setup: SpeedSetup, widths: list[int], ar: Baseline) -> dict[int, dict]:
    """The loaded drafter at each draft width: {width: the report's exl3 object}."""
    out = {}
    for w in widths:
        rounds, secs = decode(be, setup.prompts, settings(setup, w), speculative=True)
        out[w] = cell(rounds, secs, ar, w, setup)
    return out


def window_filled(c: dict, width: int) -> bool:
    """Whether some round at `width` accepted every drafted token (position width-1 was accepted at least once)."""
    acc = c.get("accept_per_position") or []
    return len(acc) >= width and acc[width - 1] > 0


def sweep(be: Backend, setup: SpeedSetup, widths: list[int], ar: Baseline) -> tuple[dict[int, dict], list[int]]:
    """`measure` from the narrowest width up, stopping after a width whose window no round filled: greedy rounds at
    any wider width then accept the same tokens and only verify more rows. (measured cells, the widths skipped)."""
    out: dict[int, dict] = {}
    ws = sorted(widths)
    for i, w in enumerate(ws):
        out.update(measure(be, setup, [w], ar))
        if not window_filled(out[w], w):
            return out, ws[i + 1:]
    return out, []


def widths_for(block_size: int, asked: list[int] | None) -> list[int]:
    """Draft widths to sweep with the reference: the recipe's, else 3, 7 and the full B-1 (each cut to B-1)."""
    full = block_size - 1
    ws = asked or [3, 7, full]
    return sorted({max(1, min(int(w), full)) for w in ws})


def best_width(sweep: dict[int, dict]) -> int | None:
    """The width with the best measured speedup (ties: the narrower)."""
    scored = [(c["speedup"], -w) for w, c in sweep.items() if c.get("speedup") is not None]
    return -max(scored)[1] if scored else None


def shadow_reference(model_dir: Path, dest: Path, tap_shift: int) -> Path:
    """The BF16 drafter as exllamav3 should read it: links to its files and a config.json with the checked tap_shift
    (exllamav3 reads the shift from the config; the user's folder is never changed)."""
    import json
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        link = dest / f.name
        if f.is_file() and f.name != "config.json":
            os.symlink(f.resolve(), link)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.setdefault("dflash_config", {})["tap_shift"] = tap_shift
    cfg.pop("tap_shift", None)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest
