"""`python -m toolkit.push`: publish a quantize run to the Hub, one branch per bitrate and the card on main.

Reads OUT_DIR/report.json, uploads each bitrate folder to its branch (4.0bpw, ...) with upload_folder, then
writes main: README.md (the measured card), report.json, report.md, tau_top1.png. Unchanged branches are
skipped, transient failures retried with backoff; re-running the same command finishes an interrupted push.
Only APIs present in huggingface_hub 1.x and 2.x are used (no upload_large_folder).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .card import (MAIN_IMAGE, check_folder_inside, check_report, human_size, inside_run, pick_pushed, render_card,
                   run_upstream)
from .names import write_public_reports
from .retry import Failed, with_retries
from .upstream import read_upstream
from ..core.cli import option
from ..core.errors import OptionError, ToolkitError
from ..core.folders import atomic_file, read_json, sha256
from ..core.locks import hold
from ..core.refs import is_repo_id

MAIN = "main"
MAIN_FILES = ("report.json", "report.md", "tau_top1.png")
IGNORE = [".*", "*/.*"]  # stamps and partial folders (.quantize.json, .4.0bpw.partial) never leave the machine
BRANCH_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass
class Upload:
    branch: str
    folder: Path                  # what upload_folder sends (a staging folder of links + the rendered README)
    files: dict[str, int]         # path in repo -> size
    bits: float | None = None     # None for main
    mirror: bool = True           # the branch holds exactly these files (stale ones are deleted); not for main


@dataclass
class PushResult:
    repo: str
    url: str | None
    status: dict[str, str] = field(default_factory=dict)  # branch -> planned | uploaded | unchanged


def list_files(folder: Path) -> dict[str, int]:
    """Files upload_folder will send from `folder` (hidden ones excluded), with their sizes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not any(fnmatch.fnmatch(rel, pat) for pat in IGNORE):
            out[rel] = p.stat().st_size
    return out


def load_report(from_dir: Path) -> dict:
    path = from_dir / "report.json"
    if not path.is_file():
        raise ToolkitError(f"--from: {from_dir} has no report.json (run python -m toolkit.quantize first)")
    report = read_json(inside_run(path, from_dir), "--from: ")
    check_report(report, from_dir)       # every folder it names must lie inside from_dir
    return report


def check_complete(report: dict, from_dir: Path) -> None:
    """Refuse a run whose report step was interrupted: the plot (written last of the report files) or a bitrate
    folder's README (written after the report) missing."""
    missing = [n for n in (MAIN_IMAGE,) if not (from_dir / n).is_file()]
    missing += [f"{r['folder']}/README.md" for r in pick_pushed(report["results"])
                if (from_dir / r["folder"]).is_dir() and not (from_dir / r["folder"] / "README.md").is_file()]
    if missing:
        raise ToolkitError(f"--from: {from_dir} is an incomplete quantize run (no {', '.join(missing)}): its report step "
                           "did not finish; re-run python -m toolkit.quantize with the same --out")


def refuse_preview(report: dict, from_dir: Path) -> None:
    """A CPU preview run (python -m toolkit.preview_run) holds fp16 stand-ins, not EXL3 weights: never uploaded."""
    for r in report["results"]:
        cfg = from_dir / r["folder"] / "config.json"
        try:
            preview = (json.loads(cfg.read_text()).get("quantization_config") or {}).get("preview")
        except (OSError, ValueError, AttributeError):
            continue
        if preview:
            raise ToolkitError(f"--from: {from_dir} is a CPU preview ({r['folder']} holds fp16 stand-ins, not EXL3 "
                               "weights): push it only with --dry-run; quantize on a GPU for weights to publish")


def link_inside(src: Path, dest: Path, root: Path) -> None:
    """Stage `src` as the link `dest`, refusing a file that resolves outside the run folder `root` (a symlink out)."""
    real = src.resolve()
    if root.resolve() not in real.parents:
        raise ToolkitError(f"--from: {src} resolves to {real}, outside {root}; refusing to upload it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.symlink_to(real)


def branch_for(template: str, row: dict) -> str:
    if re.search(r"\{[^}]*\d{4,}", template):          # {bits:>999999999} would build a gigabyte first
        raise ToolkitError(f"--branch-template: {template[:60]!r} asks for a field wider than a branch name can be")
    try:
        name = template.format(bits=float(row["bits"]), folder=row["folder"], calibrated=row["calibrated"])
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:   # {x}, {0}, {bits:d}, {bits.foo}, {bits[0]}
        raise ToolkitError(f"--branch-template: {template!r} cannot be formatted ({e}); use {{bits}}, {{folder}}, "
                           "{calibrated}") from None
    if not BRANCH_RE.match(name) or name == MAIN:
        raise ToolkitError(f"--branch-template: {template!r} gives branch {name!r}, not a usable branch name")
    return name


def check_weights(path: Path) -> None:
    """Refuse to publish a tensor file with NaN or infinite floating-point weights (one line naming the tensor)."""
    from ..core.tensorfiles import iter_tensors
    from ..dflash.loading import check_finite

    for name, t in iter_tensors(path):
        check_finite({name: t}, str(path))


def plan(report: dict, from_dir: Path, branch_template: str, repo: str, stage: Path) -> list[Upload]:
    """Branch uploads (rows whose folder exists) then main; folders are staged as links + rendered READMEs."""
    branches: dict[str, str] = {}
    for row in pick_pushed(report["results"]):
        if (from_dir / row["folder"]).is_dir():
            branch = branch_for(branch_template, row)
            if branch in branches.values():
                other = next(f for f, b in branches.items() if b == branch)
                raise ToolkitError(f"--branch-template: folders {other} and {row['folder']} both map to {branch}")
            branches[row["folder"]] = branch
    if not branches:
        folders = ", ".join(r["folder"] for r in report["results"])
        raise ToolkitError(f"--from: none of the report's folders ({folders}) exists in {from_dir}")
    uploads = []
    upstream = run_upstream(from_dir)    # confined like the bitrate folders: nothing linked out of the run
    for folder, branch in branches.items():
        row = next(r for r in report["results"] if r["folder"] == folder)
        dest = stage / branch
        dest.mkdir(parents=True)
        for rel in list_files(check_folder_inside(folder, from_dir, "folder")):
            link_inside(from_dir / folder / rel, dest / rel, from_dir)
            if rel.endswith(".safetensors"):
                check_weights(from_dir / folder / rel)
        readme = dest / "README.md"
        readme.unlink(missing_ok=True)
        readme.write_text(render_card(report, repo, bits=float(row["bits"]), branches=branches, upstream=upstream))
        uploads.append(Upload(branch, dest, list_files(dest), float(row["bits"])))
    main = stage / MAIN
    main.mkdir()
    image = None
    for name in MAIN_FILES:
        if (from_dir / name).is_file():
            link_inside(from_dir / name, main / name, from_dir)
            image = name if name.endswith(".png") else image
    write_public_reports(report, from_dir, main, read_upstream(upstream).metadata)   # names, never paths
    (main / "README.md").write_text(render_card(report, repo, branches=branches, image=image, upstream=upstream))
    uploads.append(Upload(MAIN, main, list_files(main), mirror=False))
    return uploads


def format_uploads(repo: str, uploads: list[Upload]) -> str:
    """--dry-run: the branches and files the push would upload."""
    lines = [f"repo {repo}: {len(uploads) - 1} bitrate branch(es) + main"]
    for u in uploads:
        lines.append(f"  {u.branch}  ({len(u.files)} files, {human_size(sum(u.files.values()))})")
        lines += [f"    {path}  {human_size(size)}" for path, size in u.files.items()]
    return "\n".join(lines)


def write_cards(out_dir: str | Path) -> list[Path]:
    """README.md (the measured model card) in each bitrate folder of a finished quantize run, from its report.json."""
    from_dir = Path(out_dir)
    report = load_report(from_dir)
    return [atomic_file(from_dir / r["folder"] / "README.md", render_card(report, repo=None, bits=r["bits"]))
            for r in report["results"] if (from_dir / r["folder"]).is_dir()]


def resolve_token(token: str | None) -> str:
    """The token from the argument, HF_TOKEN, or the saved `hf auth login`; never printed."""
    from huggingface_hub import get_token

    token = token or os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise ToolkitError("no Hugging Face token: set HF_TOKEN or run `hf auth login` with a write token")
    return token


def _git_sha1(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()



def is_unchanged(api, repo: str, up: Upload) -> bool:
    """True when the branch holds every file of `up` with the same content (sizes, then hashes), and for a
    mirrored branch nothing else but .gitattributes."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        remote = {f.path: f for f in api.list_repo_tree(repo, revision=up.branch, recursive=True)
                  if hasattr(f, "size") and hasattr(f, "blob_id")}
    except RevisionNotFoundError:
        return False
    if up.mirror and set(remote) - set(up.files) - {".gitattributes"}:
        return False
    for rel, size in up.files.items():
        f = remote.get(rel)
        if f is None or f.size != size:
            return False
        local = up.folder / rel
        same = (f.lfs.sha256 == sha256(local)) if f.lfs is not None else (f.blob_id == _git_sha1(local))
        if not same:
            return False
    return True


def check_options(repo: str, endpoint: str | None, retries: int, retry_delay: float) -> None:
    """Everything push can judge before reading the run or reaching the Hub: OptionError naming the field."""
    if not (is_repo_id(repo) and "/" in repo):
        raise OptionError("repo", f"must be USER/NAME, got {repo!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise OptionError("retries", f"must be a whole number >= 0, got {retries!r}")
    if not (isinstance(retry_delay, (int, float)) and math.isfinite(retry_delay) and retry_delay >= 0):
        raise OptionError("retry_delay", f"must be a number of seconds >= 0, got {retry_delay!r}")
    if endpoint is not None:
        try:
            url = urlsplit(endpoint)
            url.port            # a bad port (http://host:x) raises here
        except ValueError:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.hostname or any(c.isspace() for c in endpoint):
            raise OptionError("endpoint", f"{endpoint!r} is not an http(s) URL such as https://huggingface.co")


@dataclass
class PushOptions:
    """The options of a push, one source for `python -m toolkit.push` and `push()`."""

    repo: str = option(help="target repo, USER/NAME (created if missing)")
    out_dir: str = option(help="the quantize OUT_DIR", flag="--from")
    private: bool = option(False, "create the repo private (ignored if it exists)")
    branch_template: str = option("{bits:.1f}bpw", "branch name per bitrate; fields {bits}, {folder}, {calibrated}")
    dry_run: bool = option(False, "list branches, files and sizes; touch nothing")
    endpoint: str | None = option(None, "Hub URL (default: HF_ENDPOINT or huggingface.co)")
    retries: int = option(4, "retries per step on 5xx or dropped connections", lo=0, hi=100)
    retry_delay: float = option(2.0, "first backoff delay in seconds, doubling", lo=0, hi=3600)


def push(o: PushOptions, token: str | None = None) -> PushResult:
    """Create `o.repo` (exist_ok), one branch per bitrate folder of `o.out_dir`, and the measured card on main, with
    the options `o` (those of `python -m toolkit.push`); `token` is the Hub token (default: HF_TOKEN or the
    `hf auth login` one).

    Checked before anything is read from the Hub: the options, report.json (every folder inside `o.out_dir`) and
    that the run is complete (its report step finished)."""
    repo, endpoint, retries, retry_delay, template = o.repo, o.endpoint, o.retries, o.retry_delay, o.branch_template
    check_options(repo, endpoint, retries, retry_delay)
    branch_for(template, {"bits": 4.0, "folder": "4.0bpw", "calibrated": True})   # before reading the run
    from_dir = Path(o.out_dir)
    report = load_report(from_dir)
    check_complete(report, from_dir)
    if not o.dry_run:
        refuse_preview(report, from_dir)
    with hold(from_dir, "push", "out_dir", optional=True), tempfile.TemporaryDirectory(prefix="push-") as stage:
        uploads = plan(report, from_dir, template, repo, Path(stage))
        if o.dry_run:
            print(format_uploads(repo, uploads))
            print(f"read the cards first: python -m toolkit.card --from {from_dir} --repo {repo} [--bits B]")
            return PushResult(repo, None, {u.branch: "planned" for u in uploads})
        return _upload_all(repo, uploads, o.private, endpoint, resolve_token(token), retries, retry_delay)


@contextlib.contextmanager
def hub_endpoint(endpoint: str | None):
    """Point huggingface_hub's default endpoint at `endpoint` for the push: 1.x parses commit URLs against
    the default (HF_ENDPOINT) even when HfApi(endpoint=...) is given."""
    from huggingface_hub import constants

    saved = constants.ENDPOINT
    constants.ENDPOINT = endpoint.rstrip("/") if endpoint else saved
    try:
        yield
    finally:
        constants.ENDPOINT = saved


def _upload_all(repo, uploads, private, endpoint, token, retries, retry_delay) -> PushResult:
    with hub_endpoint(endpoint):
        return _upload_all_inner(repo, uploads, private, endpoint, token, retries, retry_delay)


def _upload_all_inner(repo, uploads, private, endpoint, token, retries, retry_delay) -> PushResult:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    result = PushResult(repo, None)
    step, user = "checking the token", None
    try:
        user = with_retries(lambda: api.whoami()["name"], "whoami", retries, retry_delay, token)
        step = f"creating {repo}"
        result.url = str(with_retries(lambda: _ensure_repo(api, repo, private), "create_repo", retries,
                                      retry_delay, token))
        for up in uploads:
            step = f"uploading {up.branch}"
            result.status[up.branch] = with_retries(lambda: _upload_one(api, repo, up), up.branch, retries,
                                                    retry_delay, token)
            print(f"{up.branch}: {result.status[up.branch]} ({len(up.files)} files, "
                  f"{human_size(sum(up.files.values()))})")
    except Failed as f:
        done = [b for b, s in result.status.items()]
        missing = [u.branch for u in uploads if u.branch not in result.status]
        progress = f"uploaded: {', '.join(done) or 'none'}; not uploaded: {', '.join(missing)}"
        raise ToolkitError(failure_line(f, step, repo, user, api.endpoint, progress)) from None
    print(f"done: {result.url}")
    return result


def failure_line(f: "Failed", step: str, repo: str, user: str | None, endpoint: str, progress: str) -> str:
    """The one error line of a failed push: which kind of failure it was, while doing what, and what got uploaded."""
    if f.status == 401:
        return f"the Hub rejected the token while {step} ({f.reason}); {progress}"
    if f.status == 403:
        return (f"permission denied while {step}: user {user!r} cannot write to {repo} "
                f"(owned by someone else, or a read-only token); {progress}")
    if f.status is not None and f.status >= 500:
        what = f"a server error at {endpoint}"
    elif f.reason in ("connection refused", "host not found", "timed out"):
        what = f"no connection to {endpoint} ({f.reason}; check --endpoint and the network)"
    elif f.reason.startswith("offline mode"):
        what = "the Hub cannot be reached in offline mode (unset HF_HUB_OFFLINE to push)"
    elif f.reason == "malformed URL":
        what = f"--endpoint {endpoint!r} is a malformed URL"
    else:
        what = "the Hub refused a request" if f.status is not None else "push failed"
    return (f"{what}: stopped while {step} after {f.attempts} attempt(s) ({f.reason}); {progress}; "
            "re-run the same command to finish")


def _ensure_repo(api, repo: str, private: bool) -> str:
    """create_repo(exist_ok=True) unless the repo is already visible (2.x builds a bad URL for a custom
    endpoint when it is asked to create a repo that exists but the token may not create)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        api.repo_info(repo)
        return f"{api.endpoint}/{repo}"
    except RepositoryNotFoundError:
        return str(api.create_repo(repo, private=private, exist_ok=True))


def _upload_one(api, repo: str, up: Upload) -> str:
    if up.branch != MAIN:
        api.create_branch(repo, branch=up.branch, exist_ok=True)
    if is_unchanged(api, repo, up):
        return "unchanged"
    what = f"{up.bits:.2f} bpw EXL3" if up.bits is not None else "model card and report"
    api.upload_folder(repo_id=repo, folder_path=str(up.folder), revision=up.branch,
                      commit_message=f"Upload {up.branch} ({what})", ignore_patterns=IGNORE,
                      delete_patterns=["*"] if up.mirror else None)
    return "uploaded"
