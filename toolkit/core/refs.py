"""Hub refs with a revision: `USER/NAME@REVISION` (a branch, tag or commit sha) or a local folder.

EXL3 quants live on branches (`4.0bpw`), so every place that names a model takes a ref: `parse_ref` splits and
validates it (a local folder stays a folder; `../..` is never a repo id), `fetch` downloads it with
huggingface_hub's snapshot_download and returns the folder with the commit sha it resolved to, so that the sha
can be recorded. Each failure is one ToolkitError line that says which it was: no such revision, no such repo
(404), a server error (5xx), offline mode, or no connection.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolkitError

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_RE = re.compile(rf"^(?:{_PART}/)?{_PART}$")
REV_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
SHA_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Ref:
    """A Hub repo at a revision (None: main), or a local folder (`path`)."""

    repo: str | None = None
    revision: str | None = None
    path: Path | None = None

    @property
    def is_local(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        if self.path is not None:
            return str(self.path)
        return f"{self.repo}@{self.revision}" if self.revision else str(self.repo)


def is_repo_id(text: str) -> bool:
    """True for `NAME` or `USER/NAME` as the Hub accepts them: letters, digits, `-_.`, no `--` or `..`."""
    return bool(REPO_RE.match(text)) and "--" not in text and ".." not in text


def is_revision(text: str) -> bool:
    """True for a branch, tag or sha the Hub can resolve (git ref rules, kept strict)."""
    return (bool(REV_RE.match(text)) and ".." not in text and "//" not in text
            and not text.endswith(("/", ".", ".lock")) and "@{" not in text)


def _flag(what: str) -> str:
    return f"--{what}: " if what else ""


def parse_ref(text: str | Path, what: str = "") -> Ref:
    """`USER/NAME`, `USER/NAME@REVISION`, or an existing folder; anything else is one ToolkitError line.

    `what` names the option in errors ("target" -> "--target: ...").
    """
    text = str(text).strip()
    if not text:
        raise ToolkitError(f"{_flag(what)}empty model name")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ToolkitError(f"{_flag(what)}{text} is a file, not a model folder")
        return Ref(path=path)
    repo, at, revision = text.partition("@")
    if not is_repo_id(repo):
        looks_local = text.startswith(("/", ".", "~")) or "\\" in text or repo.count("/") > 1
        if looks_local:
            raise ToolkitError(f"{_flag(what)}{text}: no such folder, and not a Hub repo id (USER/NAME[@REVISION])")
        raise ToolkitError(f"{_flag(what)}{text!r} is neither a folder nor a Hub repo id (USER/NAME[@REVISION])")
    if at and not revision:
        raise ToolkitError(f"{_flag(what)}{text}: nothing after '@' (give a branch, tag or commit sha)")
    if at and not is_revision(revision):
        raise ToolkitError(f"{_flag(what)}{text}: {revision!r} is not a valid branch, tag or commit sha")
    return Ref(repo=repo, revision=revision or None)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def classify(exc: BaseException) -> tuple[str, int | None]:
    """(kind, HTTP status) of a download failure: revision, repo, auth, server, offline, connection or other."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError

    for e in _chain(exc):
        if isinstance(e, RevisionNotFoundError):
            return "revision", _status(e)
        if isinstance(e, RepositoryNotFoundError):
            return "repo", _status(e)
        if isinstance(e, OfflineModeIsEnabled):
            return "offline", None
        status = _status(e)
        if status is not None and status >= 500:
            return "server", status
        if status in (401, 403):
            return "auth", status
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, (ConnectionError, TimeoutError)) or names & {"ConnectError", "TimeoutException", "NetworkError"}:
            return "connection", None
    if constants.HF_HUB_OFFLINE:
        return "offline", None
    return "other", _status(exc)


def describe(exc: BaseException, ref: Ref, what: str, host: str) -> str:
    """The one line for a failed fetch of `ref` from `host`."""
    kind, status = classify(exc)
    head = _flag(what)
    if kind == "revision":
        return f"{head}{ref}: {ref.repo} has no branch, tag or commit {ref.revision or 'main'!r} on {host}"
    if kind == "repo":
        return (f"{head}{ref}: repository {ref.repo} not found on {host} (HTTP {status or 404}; a private or gated "
                "repo also needs a token: HF_TOKEN or `hf auth login`)")
    if kind == "auth":
        return f"{head}{ref}: {host} refused access (HTTP {status}); check the token (HF_TOKEN or `hf auth login`)"
    if kind == "server":
        return f"{head}{ref}: {host} answered HTTP {status} (a server error), and it is not in the local cache; try again later"
    if kind == "offline":
        return f"{head}{ref} is not in the local Hub cache and offline mode is on (HF_HUB_OFFLINE=1)"
    if kind == "connection":
        return f"{head}{ref}: cannot connect to {host} (connection refused or timed out), and it is not in the local cache"
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
    return f"{head}{ref}: download from {host} failed ({text})"


def fetch(ref: Ref | str, what: str = "", *, allow_patterns: list[str] | None = None, endpoint: str | None = None,
          token: str | None = None, cache_dir: str | Path | None = None) -> tuple[Path, str | None]:
    """(local folder, commit sha) for a ref: a Hub snapshot at its revision, or a local folder (sha None)."""
    ref = parse_ref(ref, what) if not isinstance(ref, Ref) else ref
    if ref.is_local:
        if not ref.path.is_dir():
            raise ToolkitError(f"{_flag(what)}{ref.path}: no such folder")
        return ref.path, None
    from huggingface_hub import HfApi, constants, snapshot_download

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None      # read now, not only at huggingface_hub's import
    host = (endpoint or constants.ENDPOINT).rstrip("/")
    revision = ref.revision or "main"
    try:
        path = Path(snapshot_download(ref.repo, revision=revision, allow_patterns=allow_patterns, endpoint=endpoint,
                                      token=token, cache_dir=str(cache_dir) if cache_dir else None))
        # The cache keeps each snapshot under snapshots/<commit sha>; ask the Hub only if that is not the layout.
        sha = path.name if SHA_RE.match(path.name) else HfApi(endpoint=endpoint, token=token).model_info(
            ref.repo, revision=revision).sha
    except ToolkitError:
        raise
    except Exception as e:  # noqa: BLE001 - every huggingface_hub/httpx failure becomes one classified line
        raise ToolkitError(describe(e, ref, what, host)) from None
    return path, sha
