"""Train and measure the SmolLM2-135M-Instruct DFlash drafter on one GPU, inside 9.5 minutes.

Here (CPU, once):   python -m experiments.smol_device pack
    splits the GGUF into parts that each fit one call beside the working tree (64 MiB in all): .smol1/part1,
    .smol2/part2, ..., the last in .smol/ with .smol/LICENSE and .smol/prompts.jsonl (the ShareGPT + stdlib-code
    prompt pool), and fetches .whl/gguf-*.whl (the device has no gguf and no network); it prints the parts.
Device, call k:     carry [".smolK/partK"], command `mkdir -p /tmp/parts && cp .smolK/partK /tmp/parts/` for each
                    part but the last (/tmp survives while the machine stays warm: issue the next call within its
                    30 s idle window)
Device, last call:  carry [".smol/partN", ".smol/LICENSE", ".smol/prompts.jsonl", ".whl/gguf-0.19.0-py3-none-any.whl"],
                    command `cp /tmp/parts/part* .smol/ && python3 -m experiments.smol_device run`   (7.5 minutes on an H200)
Or, the last call `... && python3 -m experiments.smol_device stage`: only join and prepare the target into
                    /tmp/smol-run/smollm2-135m-instruct for later calls on the same warm machine (no training).
Here, afterwards:   python -m experiments.smol_device install FILES_AT   (merges the shards into toolkit/data/smollm2_dflash)

`run`: (a) joins the parts and checks the sha256, (b) `toolkit.assets.smollm2 prepare --gguf`, (c) trains the drafter
with a --minutes budget (the target's own greedy answers to ~4000 prompts, batched on the GPU), (d) measures
tau at B=8 and 16 on the held-out chat and code prompts (torch backend, fp16), (e) writes the drafter (its
safetensors in two shards, each < 16 MiB), results.json and tau.json into $OUT. Partial results are written
after each stage, so a timeout still returns what was done. SMOL_QUICK=1 (--quick) runs the same flow tiny, on CPU.

`exl3`: the pair on exllamav3, right after `run` on the same warm machine, reading the prepared target and the
trained drafter from /tmp/smol-run (or SMOL_TARGET / SMOL_DRAFT; `source .device/on-device.sh && python -m
experiments.smol_device exl3`, carry [".device"], writes $OUT/exl3.json): (1) `toolkit.assets.padding` both to
hidden 768 (exllamav3 needs 128-aligned widths), (2) `toolkit.eval_tau --backend exllamav3` on all held-out
prompts, B = 8 and 16, (3) `toolkit.bench --backend exllamav3`: AR and speculative in one process, c = 1 and 8,
(4) `toolkit.quant` with quantize/smollm2-135m-dflash.toml at 2, 3, 4, 5, 6 and 8 bpw, calibrated and not, (5) tau
of every EXL3 drafter on exllamav3 itself. Results are written after each stage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import site
import sys
import zipfile
from pathlib import Path

from experiments.harness import Run, device_name, download_wheels, env_float

ROOT = Path(__file__).resolve().parents[1]
CHAT_NEEDED = 5200                                          # ShareGPT prompts read into the pool (training + held out)
SMOL, WHL = ROOT / ".smol", ROOT / ".whl"                  # .smol1, .smol2, ...: the earlier calls' parts
CARRY_MIB = 64                                              # what one device call carries, the working tree included
WORK = Path("/tmp/smol-run")
RECIPE = ROOT / "quantize" / "smollm2-135m-dflash.toml"


def tree_bytes() -> int:
    """Bytes of the working tree that travels with every device call (tracked and untracked, not ignored)."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def pack() -> None:
    """Local: split the GGUF, copy its license, write the prompt pool, fetch the gguf wheel."""
    from toolkit.assets.smollm2 import GGUF_SHA256, locate_source, sha256
    from toolkit.train.data import prompt_pool, write_pool

    SMOL.mkdir(exist_ok=True)
    src, lic = locate_source(None, None, SMOL / "src")
    assert sha256(src) == GGUF_SHA256
    data = src.read_bytes()
    room = CARRY_MIB * 2**20 - tree_bytes() - 4 * 2**20    # what a call carries beside the tree (the last one: + prompts)
    n = -(-len(data) // room)
    cut = -(-len(data) // n)
    for old in [*ROOT.glob(".smol[0-9]*/part*"), *SMOL.glob("part*")]:
        old.unlink()
    for i in range(n):
        folder = SMOL if i == n - 1 else ROOT / f".smol{i + 1}"
        folder.mkdir(exist_ok=True)
        (folder / f"part{i + 1}").write_bytes(data[i * cut:(i + 1) * cut])
    (SMOL / "LICENSE").write_text(lic)
    shutil.rmtree(SMOL / "src", ignore_errors=True)
    pool = prompt_pool(None, None, chat_needed=CHAT_NEEDED)
    write_pool(SMOL / "prompts.jsonl", pool)
    download_wheels(WHL, ["gguf"])
    for p in sorted([*ROOT.glob(".smol[0-9]*/part*"), *SMOL.iterdir(), *WHL.glob("gguf-*.whl")]):
        print(f"{p.relative_to(ROOT)}  {p.stat().st_size / 2**20:.1f} MiB")
    print(f"prompt pool: {len(pool)} prompts")


def join_gguf() -> dict:
    from toolkit.assets.smollm2 import GGUF_NAME, GGUF_SHA256, sha256

    parts = sorted(SMOL.glob("part[0-9]*"), key=lambda p: int(p.name[4:]))
    if not parts or len(parts) != int(parts[-1].name[4:]):
        raise FileNotFoundError(f"parts {[p.name for p in parts]} in .smol: copy /tmp/parts/part* there first (see the docstring)")
    dst = WORK / "gguf" / GGUF_NAME
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    got = sha256(dst)
    if got != GGUF_SHA256:
        raise ValueError(f"joined GGUF sha256 {got} != {GGUF_SHA256}")
    shutil.copy(SMOL / "LICENSE", dst.parent / "LICENSE")
    return {"gguf": str(dst), "bytes": dst.stat().st_size, "sha256": got}


def install_gguf() -> dict:
    """The gguf wheel unpacked into a private site folder (before transformers is imported)."""
    try:
        import gguf  # noqa: F401
        return {"gguf": "already installed"}
    except ImportError:
        pass
    lib = WORK / "pylib"
    whl = sorted(WHL.glob("gguf-*.whl"))
    if not whl:
        raise FileNotFoundError("no .whl/gguf-*.whl: carry it")
    with zipfile.ZipFile(whl[-1]) as z:                     # a pure-Python wheel is a zip of the package + dist-info
        z.extractall(lib)
    site.addsitedir(str(lib))                               # a private site folder: the device has no network to pip from
    importlib.import_module("gguf")
    return {"gguf": str(whl[-1].name)}


def shard(src: Path, dst: Path, n: int = 2) -> list[str]:
    """model.safetensors split into n files of about equal size (read back by load_drafter, which globs)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    groups: list[dict] = [{} for _ in range(n)]
    acc = 0
    for k in sorted(sd):
        groups[min(n - 1, acc * n // total)][k] = sd[k]
        acc += sd[k].numel() * sd[k].element_size()
    names = []
    for i, g in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(g, str(dst / name), metadata={"format": "pt"})
        names.append(name)
    return names


def copy_drafter(draft: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "README.md", "heldout.json"):     # training.json is in results.json: 8 files come back
        shutil.copy(draft / name, out / name)
    names = shard(draft / "model.safetensors", out)
    return {"files": names, "mib": [round((out / n).stat().st_size / 2**20, 2) for n in names]}


def run(budget_s: float, eval_reserve_s: float, eval_limit: int, quick: bool, train: bool = True) -> int:
    os.environ.setdefault("TQDM_MININTERVAL", "20")        # a progress line every 20 s, not every 0.1 s
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    WORK.mkdir(parents=True, exist_ok=True)
    rn = Run("results.json", budget_s=budget_s, section="stages")
    out = rn.path.parent
    joined = rn.step("join_gguf", join_gguf)
    rn.step("install_gguf", install_gguf)
    import torch

    rn.results["device"] = device_name()
    rn.results["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    from toolkit.assets.smollm2 import prepare

    target = WORK / "smollm2-135m-instruct"
    prep = rn.step("prepare", lambda: vars(prepare(out=str(target), gguf=joined["gguf"], check_prompts=3))) if joined else None
    if prep is None or not train:                           # `stage`: the target in /tmp for the next calls
        return rn.finish()
    from toolkit.train.trainer import train_drafter

    draft = WORK / "smollm2_dflash"
    minutes = (rn.left() - eval_reserve_s - 15) / 60
    kw = dict(chat=5000, code=1500, heldout_chat=24, heldout_code=24, max_new_tokens=192, gen_batch=1024, steps=100_000,
              batch_seqs=64, anchors=16, lr=1e-3, warmup=200, device="cuda", checkpoint_every=2000, log_every=100)
    if quick:                                               # a CPU dry run of the whole flow
        kw.update(chat=6, code=2, heldout_chat=1, heldout_code=1, max_new_tokens=16, gen_batch=8, steps=6, batch_seqs=2,
                  anchors=2, warmup=2, device="auto", log_every=1)
    rn.results["train_options"] = kw
    info = rn.step("train", lambda: {k: v for k, v in train_drafter(
        str(target), str(draft), prompts=str(SMOL / "prompts.jsonl"), minutes=minutes, **kw).items() if k != "config"})
    if info is None:
        return rn.finish()
    rn.step("copy_drafter", copy_drafter, draft, out)
    from toolkit.eval_tau import EvalTauOptions, eval_tau

    left = (rn.left() - 10) / 60
    tau = rn.step("eval_tau", lambda: eval_tau(EvalTauOptions(
        str(target), str(draft), max_new_tokens=16 if quick else 128, limit=eval_limit,
        device="auto" if quick else "cuda", minutes=left, out=str(out / "tau.json"), write_card=True, quiet=True)))
    if tau is not None:
        shutil.copy(draft / "README.md", out / "README.md")
        rn.results["tau"] = tau["tau"]
    rn.log("tau", json.dumps(rn.results.get("tau")))
    return rn.finish()


def install(files_at: str, to: str = str(ROOT / "toolkit" / "data" / "smollm2_dflash")) -> None:
    """Local: the device's files as a drafter folder (one model.safetensors), written atomically."""
    from safetensors.torch import load_file, save_file

    from toolkit.core.folders import atomic_dir

    src = Path(files_at)
    with atomic_dir(Path(to)) as tmp:
        sd = {}
        for f in sorted(src.glob("model-*.safetensors")):
            sd.update(load_file(str(f)))
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "README.md", "heldout.json"):
            shutil.copyfile(src / name, tmp / name)              # not copy: files_at is read-only
        res = json.loads((src / "results.json").read_text())       # training.json rides in results.json (8 files back)
        info = {"config": res.get("train_options", {})} | res["stages"]["train"]["result"]
        (tmp / "training.json").write_text(json.dumps(info, indent=1) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
    print(f"wrote {to}")


def tau_only(res: dict) -> dict:
    return {"tau": res["tau"], "prompts": res["prompts"], "complete": res["complete"],
            "accept_16": {c: d.get("16", {}).get("accept_per_position", [])[:4] for c, d in res["detail"].items()}}


def measure_exl3(run: Run, target: Path, draft: Path) -> None:
    """`exl3`: the pair padded, tau per backend, the bench against AR, the recipe per bitrate, tau per EXL3 drafter."""
    from experiments.pair_mode import heldout_jsonl
    from toolkit.assets.padding import pad
    from toolkit.bench import BenchOptions, bench
    from toolkit.core.errors import ToolkitError
    from toolkit.eval_tau import EvalTauOptions, eval_tau
    from toolkit.quant import QuantizeOptions, quantize

    out = run.path.parent
    pt, pd = WORK / "pad" / "target", WORK / "pad" / "draft"
    run.step("pad", lambda: [str(pad(str(target), str(pt))), str(pad(str(draft), str(pd)))])
    held = draft / "heldout.json"
    kw = dict(heldout=str(held), block_sizes=[8, 16], max_new_tokens=128, backend="exllamav3", concurrency=24, quiet=True)
    bf16 = EvalTauOptions(str(pt), str(pd), out=str(WORK / "tau_exl3.json"), **kw)
    run.step("tau_exl3_bf16", lambda: tau_only(eval_tau(bf16)), need_s=30)
    prompts = heldout_jsonl(held, WORK / "heldout.jsonl")

    def run_bench() -> dict:
        r = bench(BenchOptions(target=str(pt), draft=str(pd), backend="exllamav3", prompts=str(prompts), block_sizes=[8, 16], concurrency=[1, 8],
                  max_new_tokens=128, limit=16, out=str(out / "bench"), quiet=True))
        return {"ar": r["ar"], "cells": [{k: c[k] for k in ("block_size", "concurrency", "tau", "tok_s", "ar_tok_s", "speedup", "lossless")
                                          if k in c} for c in r["cells"]]}

    run.step("bench_exl3", run_bench, need_s=40)
    q = WORK / "q"

    def run_quantize() -> dict:
        try:
            rep = quantize(QuantizeOptions(recipe=str(RECIPE), model=str(pd), target=str(pt), out=str(q),
                                           also_uncalibrated=True, force=True), progress=False)
            verdict = "pass"
        except ToolkitError as e:                       # below a threshold: the report is still written
            verdict = str(e)[:600]
            rep = json.loads((q / "report.json").read_text()) if (q / "report.json").is_file() else None
        for name in ("report.md", "report.json", "tau_top1.png"):
            if (q / name).is_file():
                shutil.copy(q / name, out / name)
        return {"verdict": verdict, "bf16_tau": (rep or {}).get("bf16", {}).get("tau"),
                "results": [{k: r.get(k) for k in ("folder", "bits", "calibrated", "size_bytes", "kl", "top1", "tau", "passed")}
                            for r in (rep or {}).get("results", [])]}

    qr = run.step("quantize", run_quantize, need_s=200)
    if qr:
        per: dict = {}
        run.results["tau_exl3_per_bitrate"] = per
        for r in qr["results"]:
            folder = q / r["folder"]
            opts = EvalTauOptions(str(pt), str(folder), **kw)
            res = run.step(f"tau_exl3_{r['folder']}", lambda o=opts: tau_only(eval_tau(o)), need_s=15)
            if res:
                per[r["folder"]] = res["tau"]


def exl3(target: Path, draft: Path, budget_s: float) -> int:
    run = Run("exl3.json", budget_s=budget_s, section="stages")
    run.results.update(device=device_name(), inputs={"target": str(target), "draft": str(draft)})
    missing = [p for p in (target, draft) if not (p / "config.json").is_file()]
    if missing:
        run.errors["inputs"] = f"{missing[0]} is missing: run python -m experiments.smol_device run first, on this warm machine"
        return run.finish()
    measure_exl3(run, target, draft)
    return run.finish()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.smol_device", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pack", help="here: split the GGUF, write the prompt pool, fetch the gguf wheel")
    r = sub.add_parser("run", help="on the device: join, prepare, train, measure tau; results into $OUT")
    r.add_argument("--budget-s", type=float, default=env_float("SMOL_BUDGET_S", 550),
                   help="the call's time, less a margin for the copy-back (default: SMOL_BUDGET_S, else 550)")
    r.add_argument("--eval-reserve-s", type=float, default=env_float("SMOL_EVAL_S", 75),
                   help="seconds kept for measuring tau after training (default: SMOL_EVAL_S, else 75)")
    r.add_argument("--eval-limit", type=int, default=int(env_float("SMOL_EVAL_LIMIT", 8)),
                   help="held-out prompts per category (default: SMOL_EVAL_LIMIT, else 8)")
    r.add_argument("--quick", action="store_true", default=os.environ.get("SMOL_QUICK") == "1",
                   help="the same flow tiny, on CPU (default: SMOL_QUICK=1)")
    st = sub.add_parser("stage", help="on the device: join the GGUF and prepare the target in /tmp/smol-run (no training)")
    st.add_argument("--budget-s", type=float, default=300, help="seconds for the call (default 300)")
    x = sub.add_parser("exl3", help="on the device, after run: the pair on exllamav3 (tau, bench, tau per bitrate)")
    x.add_argument("--target", type=Path, default=Path(os.environ.get("SMOL_TARGET", WORK / "smollm2-135m-instruct")),
                   help="the prepared SmolLM2 target (default: SMOL_TARGET, else /tmp/smol-run/smollm2-135m-instruct)")
    x.add_argument("--draft", type=Path, default=Path(os.environ.get("SMOL_DRAFT", WORK / "smollm2_dflash")),
                   help="the trained drafter (default: SMOL_DRAFT, else /tmp/smol-run/smollm2_dflash)")
    x.add_argument("--budget-s", type=float, default=env_float("SMOL3_BUDGET_S", 560),
                   help="start no stage that does not fit in what is left of it (default: SMOL3_BUDGET_S, else 560)")
    i = sub.add_parser("install", help="here, afterwards: the device's files into toolkit/data/smollm2_dflash")
    i.add_argument("files_at", help="the folder the device call's files were fetched to")
    i.add_argument("--to", default=str(ROOT / "toolkit" / "data" / "smollm2_dflash"), help="drafter folder to write")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        pack()
        return 0
    if a.cmd == "install":
        install(a.files_at, a.to)
        return 0
    if a.cmd == "exl3":
        return exl3(a.target, a.draft, a.budget_s)
    if a.cmd == "stage":
        return run(a.budget_s, 0, 0, False, train=False)
    return run(a.budget_s, a.eval_reserve_s, a.eval_limit, a.quick)


if __name__ == "__main__":
    sys.exit(main())
