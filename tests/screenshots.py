"""The docs' screenshots are made by the browser test (tests/slow/test_app_browser.py), never kept by hand: each PNG
carries, in a text chunk, a fingerprint of the page text it shows (the demo's header, the legend, the footer), and
tests/test_docs_true.py checks it against today's page. Regenerate them with REGENERATE."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = {"tiny": ROOT / "docs" / "img" / "screenshot.png", "smollm2": ROOT / "docs" / "img" / "screenshot_smollm2.png"}
REGENERATE = {kind: f"{'DFLASH_DEMO=smollm2 ' if kind == 'smollm2' else ''}DFLASH_SCREENSHOT={path.relative_to(ROOT)} "
                    "python -m pytest tests/slow/test_app_browser.py -k fixed_block"
              for kind, path in SHOTS.items()}
KEY = "dflash-page"


def page_text(kind: str) -> str:
    """The text the page shows before any turn, for the CPU demo of `kind`, tags stripped."""
    from toolkit.app import render, ui
    from toolkit.app.models import Loaded

    class Be:
        block_size, max_context, supports_thinking = 16, 2048, False

    loaded = Loaded(Be(), demo=True, backend_name="torch", device="cpu", demo_kind=kind)
    html = ui.header_html(loaded) + render.legend_html() + ui.FOOTER
    return re.sub(r"<[^>]+>", " ", html)


def fingerprint(kind: str) -> str:
    return hashlib.sha256(page_text(kind).encode()).hexdigest()[:16]


def stamp(src: Path, dst: Path, kind: str) -> None:
    """Copy the browser's PNG to `dst` with the fingerprint of the page it shows."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text(KEY, fingerprint(kind))
    info.add_text("made-by", REGENERATE[kind])
    Image.open(src).save(dst, pnginfo=info, optimize=True)


def stamped(path: Path) -> str | None:
    from PIL import Image

    return Image.open(path).text.get(KEY)
