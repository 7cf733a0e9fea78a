"""Real browser: Debian chromium driven by Playwright against the app on the tiny pair: a turn at the default block
size auto (the screenshot), then one at a fixed B = 16 (coloured tokens, popups).

Needs `apt-get install chromium` (no `playwright install`). Set DFLASH_SCREENSHOT=docs/img/screenshot.png to refresh
the docs screenshot from this run; with DFLASH_DEMO=smollm2 the same test runs on the SmolLM2 demo pair
(docs/img/screenshot_smollm2.png was made that way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
TINY = os.environ.get("DFLASH_DEMO", "tiny").lower() == "tiny"
PROMPT = "json.dumps" if TINY else "Write a Python function that returns the n-th Fibonacci number."
pytestmark = [pytest.mark.browser, pytest.mark.slow]
pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} missing (apt-get install chromium)", allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402

from toolkit.app.models import Hardware, ModelSpec, load  # noqa: E402
from toolkit.app.ui import build_app, serve  # noqa: E402


@pytest.fixture(scope="module")
def url():
    loaded = load(ModelSpec(), Hardware())
    assert loaded.error is None, loaded.error
    demo = serve(build_app(loaded), block=False)
    yield demo.local_url
    demo.close()


def test_browser_chat_round(url, tmp_path):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.get_by_text("Demo on tiny models" if TINY else "SmolLM2").first.wait_for()
            block = page.locator("#dfl-block input")
            assert "auto" in block.input_value()                              # the drafting policy is the default
            page.locator("#dfl-input textarea").fill(PROMPT)
            page.locator("#dfl-send").click()
            page.locator(".dfl-banner.done").wait_for(timeout=300_000)      # both panels finished
            banner = page.locator(".dfl-banner.done").inner_text()
            assert "×" in banner and "tok/s" in banner and "outputs identical" in banner and "block auto:" in banner
            page.get_by_text("Every round: its width").click()                 # open the round view
            assert "width chosen per round" in page.locator("#dfl-blocks").inner_text()
            assert page.locator("#dfl-spec .dfl-stream").inner_text().strip()
            page.wait_for_timeout(500)   # let the plots draw
            shot = tmp_path / "app.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
            if os.environ.get("DFLASH_SCREENSHOT"):
                shutil.copy(shot, os.environ["DFLASH_SCREENSHOT"])

            block.click()                                                     # a fixed block: every round drafts
            page.get_by_role("option", name="16", exact=True).click()
            assert block.input_value() == "16"
            page.locator("#dfl-input textarea").fill(PROMPT)
            page.locator("#dfl-send").click()
            page.locator(".dfl-banner.done", has_not_text="block auto").wait_for(timeout=300_000)
            banner = page.locator(".dfl-banner.done").inner_text()
            assert "×" in banner and "tok/s" in banner and "outputs identical" in banner
            coloured = page.locator("#dfl-spec .tok.accepted, #dfl-spec .tok.correction, #dfl-spec .tok.bonus")
            assert coloured.count() > 0 and coloured.first.is_visible()
            assert page.locator("#dfl-ar .dfl-stream").inner_text().strip()
            assert "tok/s" in page.locator("#dfl-ar .dfl-rate").inner_text()
            assert "τ" in page.locator("#dfl-tau").inner_text()
            rounds = page.locator("#dfl-spec .rnd")
            if rounds.count():
                rounds.nth(min(1, rounds.count() - 1)).hover()
                assert page.locator("#dfl-spec .rnd .pop:visible").count() == 1
        finally:
            browser.close()
