"""The upstream drafter's own card and license, kept with a quantize run so that the published card can credit them.

quantize calls `copy_upstream(model_dir, out)` when it reads the drafter: README.md and every LICENSE* file go to
`OUT/upstream/`. `read_upstream` gives the card's body (front matter removed, otherwise verbatim) and its metadata;
`license_fields` copies license / license_name / license_link from that metadata, nothing guessed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from huggingface_hub.repocard import REGEX_YAML_BLOCK

from ..core.errors import ToolkitError
from ..core.folders import atomic_dir

UPSTREAM = "upstream"          # the folder under a quantize OUT
HUB = "https://huggingface.co"


@dataclass
class Upstream:
    readme: str | None = None                         # the card's body, verbatim, without its front matter
    metadata: dict = field(default_factory=dict)      # the card's YAML front matter ({} when none or unreadable)
    licenses: list[str] = field(default_factory=list)  # LICENSE* file names in the folder


def is_license(name: str) -> bool:
    return name.upper().startswith(("LICENSE", "LICENCE"))


def copy_upstream(model_dir: str | Path, out: str | Path) -> Path:
    """Copy README.md and LICENSE* of the drafter folder `model_dir` to `out/upstream/` (replaced as a whole)."""
    src = Path(model_dir)
    if not src.is_dir():
        raise ToolkitError(f"copy_upstream: {src} is not a folder")
    names = [p.name for p in sorted(src.iterdir()) if p.is_file() and (p.name == "README.md" or is_license(p.name))]
    dest = Path(out) / UPSTREAM
    with atomic_dir(dest) as tmp:
        for name in names:
            shutil.copyfile(src / name, tmp / name)
    return dest


def split_front_matter(text: str) -> tuple[dict, str]:
    """(metadata, body) of a card; the body is the text after the front matter, untouched but for leading blank lines."""
    match = REGEX_YAML_BLOCK.search(text)
    if not match:
        return {}, text.lstrip("\r\n")
    try:
        meta = yaml.safe_load(match.group(2)) or {}
    except yaml.YAMLError:
        meta = {}
    return (meta if isinstance(meta, dict) else {}), text[match.end():].lstrip("\r\n")


def read_upstream(folder: str | Path | None) -> Upstream:
    """What `copy_upstream` left in `folder` (a missing folder or README reads as none)."""
    if folder is None or not Path(folder).is_dir():
        return Upstream()
    folder = Path(folder)
    licenses = sorted(p.name for p in folder.iterdir() if p.is_file() and is_license(p.name))
    readme = folder / "README.md"
    if not readme.is_file():
        return Upstream(licenses=licenses)
    meta, body = split_front_matter(readme.read_text(encoding="utf-8", errors="replace"))
    return Upstream(readme=body, metadata=meta, licenses=licenses)


def upstream_url(model: str, revision: str | None, path: str | None = None) -> str:
    """A link into the upstream repo at the revision the run used (main when unknown)."""
    if path is None:
        return f"{HUB}/{model}/tree/{revision}" if revision else f"{HUB}/{model}"
    return f"{HUB}/{model}/blob/{revision or 'main'}/{path}"


def license_fields(up: Upstream, model: str, revision: str | None) -> dict:
    """license, and license_name / license_link where present, from the upstream metadata; a relative
    license_link (e.g. `LICENSE`) is made absolute into the upstream repo, since this repo does not hold it."""
    meta = up.metadata
    lic = meta.get("license")
    if isinstance(lic, list):
        lic = lic[0] if lic else None
    if not lic:
        return {}
    out = {"license": str(lic)}
    if meta.get("license_name"):
        out["license_name"] = str(meta["license_name"])
    link = meta.get("license_link")
    if link:
        link = str(link)
        out["license_link"] = link if "://" in link else upstream_url(model, revision, link.removeprefix("./").lstrip("/"))
    return out
