"""Resolve --model / --target: a local folder as is, a Hub ref (`USER/NAME[@REVISION]`) through core.refs.

A fetch returns the folder and the commit sha the revision resolved to (recorded in report.json). A dry run
never touches the network: it reads a Hub ref's config.json from the local cache only.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ToolkitError
from ..core.refs import SHA_RE, Ref, fetch, parse_ref
from ..core.target import TargetInfo

# A config-only fetch: the configs, the tokenizer (to plan with the real prompt lengths) and the safetensors index
# (the weights' size), so the plan's memory check runs before the weights are downloaded.
CONFIG_FILES = ["config.json", "generation_config.json", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "*.jinja", "vocab.*", "merges.txt"]


def split_ref(text: str, what: str) -> tuple[str, str | None]:
    """(repo or folder, revision named after '@') of a --model / --target value; a folder has no revision."""
    ref = parse_ref(text, what)
    return (str(ref.path), None) if ref.is_local else (ref.repo, ref.revision)


def hub_ref(ref: str, revision: str | None, what: str) -> Ref:
    r = parse_ref(ref, what)
    if r.is_local:
        return r
    if r.revision and revision and r.revision != revision:
        raise ToolkitError(f"--{what}: {ref} names revision {r.revision!r}, and the revision given apart is "
                           f"{revision!r}; give it once")
    return Ref(repo=r.repo, revision=r.revision or revision)


def from_cache(ref: Ref, what: str, config_only: bool) -> Path:
    """The cached snapshot of a Hub ref, without the network."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref.repo, revision=ref.revision, local_files_only=True,
                                      allow_patterns=CONFIG_FILES if config_only else None))
    except Exception:  # noqa: BLE001 - not cached, in any of huggingface_hub's ways of saying so
        raise ToolkitError(f"--{what}: {ref} is not in the local Hub cache (a dry run does not download); pass a "
                           f"local folder with --{what} instead") from None


def fetch_ref(ref: str, revision: str | None = None, what: str = "model", config_only: bool = False,
              cache_only: bool = False) -> tuple[Path, str | None]:
    """(local folder, commit sha) for `ref`; the sha is None for a local folder. config_only fetches just
    CONFIG_FILES; cache_only never touches the network."""
    r = hub_ref(ref, revision, what)
    if r.is_local:
        return r.path.expanduser().resolve(), None
    if cache_only:
        path = from_cache(r, what, config_only)
        return path, path.name if SHA_RE.match(path.name) else None
    try:
        return fetch(r, what, allow_patterns=CONFIG_FILES if config_only else None)
    except ToolkitError as e:
        text = str(e)
        if "offline" in text or "cannot connect" in text:
            raise ToolkitError(f"{text}; pass a local folder with --{what} instead") from None
        raise


def resolve(ref: str, revision: str | None = None, what: str = "model", config_only: bool = False,
            cache_only: bool = False) -> Path:
    """A local folder for `ref` (see fetch_ref)."""
    return fetch_ref(ref, revision, what, config_only, cache_only)[0]


def target_kind(cfg: dict) -> str:
    """'exl3' for an exllamav3 model, else 'hf' (a transformers checkpoint, BF16 or otherwise)."""
    return "exl3" if TargetInfo(cfg).exl3 else "hf"
