"""Real browser: Debian chromium driven by Playwright against the CPU app on the tiny pair: a short answer at the
default block size auto, with a policy that never drafts (all plain AR: no ratio shown), then one at a fixed B = 16 (a
lockstep ratio with its spread, coloured tokens, popups), at a desktop width and at a phone's; an auto answer with
one drafted round (no verdict); a visitor's second turn, and another visitor's first, each with its acceptance
afresh and the round costs of the turns before; Send during a turn (disabled; Enter keeps the prompt) and an empty
Send (nothing changes).

Needs `apt-get install chromium` (no `playwright install`). The docs' screenshots come from this test's run of the
page (tests/screenshots.py has the commands; DFLASH_SCREENSHOT names the file, DFLASH_DEMO=smollm2 runs the SmolLM2
demo pair): each is stamped with the page text it shows, which tests/test_docs_true.py checks against today's.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from toolkit.policy.chooser import Policy

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
def app():
    loaded = load(ModelSpec(), Hardware())
    assert loaded.error is None, loaded.error
    demo = serve(build_app(loaded), block=False)
    yield demo
    demo.close()


@pytest.fixture()
def url(app):
    return app.local_url


@pytest.fixture()
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            yield b
        finally:
            b.close()


def send(page, prompt: str, block: str | None = None, max_new: int | None = None) -> str:
    """Ask once (optionally at a fixed block and a new-token budget); the finished banner's text."""
    if block is not None:
        page.locator("#dfl-block input").click()
        page.get_by_role("option", name=block, exact=True).click()
        assert page.locator("#dfl-block input").input_value() == block
    if max_new is not None:
        box = page.locator("#dfl-max-new input[type=number]")
        box.fill(str(max_new))
        box.press("Enter")
    before = page.locator(".dfl-banner.done").count() and page.locator(".dfl-banner.done").inner_text()
    page.locator("#dfl-input textarea").fill(prompt)
    page.locator("#dfl-send").click()
    page.wait_for_function("b => { const d = document.querySelector('.dfl-banner.done'); return d && d.innerText !== b; }",
                           arg=before or "", timeout=300_000)
    return page.locator(".dfl-banner.done").inner_text()


def test_browser_all_plain_ar_then_fixed_block(url, browser, tmp_path, monkeypatch):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.get_by_text("Demo on tiny models" if TINY else "SmolLM2").first.wait_for()
    assert "PyTorch (CPU)" in page.title() and "ExLlamaV3" not in page.title()     # the backend that runs
    assert "auto" in page.locator("#dfl-block input").input_value()                # the drafting policy is the default

    monkeypatch.setattr(Policy, "width", lambda self, jobs=1: 0)                  # auto, a policy that never drafts
    banner = send(page, PROMPT, max_new=6)
    monkeypatch.undo()
    assert "block auto: all" in banner and "rounds plain AR" in banner
    assert "No speedup to report" in banner and "×" not in banner and "faster" not in banner
    page.get_by_text("Every round: its block").click()
    assert "block per round: 1 (AR)" in page.locator("#dfl-blocks").inner_text()
    assert page.locator("#dfl-spec .dfl-stream").inner_text().strip()
    page.locator("#dfl-hist").get_by_text("Tokens per target forward").wait_for(state="visible", timeout=30_000)
    assert "0.000000" not in page.locator("#dfl-hist").inner_text()                # an empty histogram keeps its axis

    banner = send(page, PROMPT, block="16", max_new=48)                           # every round drafts: a ratio
    assert re.search(r"\d\.\d\d×", banner) and "spread" in banner and "outputs identical" in banner
    assert "One lockstep run of each" in banner                                   # a CPU: the runs alternated
    assert "block auto" not in banner
    coloured = page.locator("#dfl-spec .tok.accepted, #dfl-spec .tok.correction, #dfl-spec .tok.bonus")
    assert coloured.count() > 0 and coloured.first.is_visible()
    assert "tok/s" in page.locator("#dfl-ar .dfl-rate").inner_text()
    tau = page.locator("#dfl-tau").inner_text()
    assert "out of 16 possible" in tau and "block 16: 15 drafted + 1" in tau
    assert "block 16 (15 drafted)" in page.locator("#dfl-blocks").inner_text()    # the same words as τ's
    rounds = page.locator("#dfl-spec .rnd")
    rounds.nth(min(1, rounds.count() - 1)).hover()
    assert page.locator("#dfl-spec .rnd .pop:visible").count() == 1
    page.wait_for_timeout(500)   # let the plots draw
    shot = tmp_path / "app.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("DFLASH_SCREENSHOT"):                                       # the docs' screenshot, stamped
        from screenshots import stamp

        stamp(shot, Path(os.environ["DFLASH_SCREENSHOT"]), "tiny" if TINY else "smollm2")


def test_browser_narrow_screen_keeps_the_plot_titles(url, browser):
    """At a phone's width each plot takes a whole line, so its title is not cut."""
    page = browser.new_page(viewport={"width": 420, "height": 900})
    page.goto(url)
    page.locator("#dfl-input textarea").wait_for()
    for plot in ("#dfl-acc", "#dfl-hist"):
        box = page.locator(plot).bounding_box()
        assert box["width"] >= 300, (plot, box)
    # the plots draw after the page loads: wait for the title rather than read it at once
    page.locator("#dfl-acc").get_by_text("Acceptance by position").first.wait_for(state="visible", timeout=30_000)


def test_browser_one_drafted_round_gives_no_verdict(url, browser, monkeypatch):
    """An auto answer whose policy drafted one round (a probe) decoded as AR: no faster or slower, no ratio."""
    def one_probe(self, jobs=1):
        self._rounds_seen = getattr(self, "_rounds_seen", 0) + 1
        return self.block_size - 1 if self._rounds_seen == 3 else 0

    monkeypatch.setattr(Policy, "width", one_probe)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    banner = send(page, PROMPT, max_new=40)
    assert re.search(r"block auto: 1 of \d+ rounds speculative", banner)
    assert "No speedup to report" in banner and "decoded as plain AR" in banner
    assert "faster" not in banner and "slower" not in banner and "×" not in banner


def test_browser_turns_start_their_acceptance_afresh_and_carry_the_round_costs(app, browser):
    """A visitor's second turn, and another visitor's first, decode from the acceptance state the start-up left,
    with the round costs the earlier turns learnt."""
    import pickle

    from toolkit.policy.chooser import Policy

    def state(p) -> bytes:
        return pickle.dumps({a: v for a, v in vars(p).items() if a != "costs"})

    be = app.handler.loaded.backend
    starts, prompts, inner = [], [], be.generate

    def recording(ids, settings, speculative=True):
        if speculative:
            starts.append({k: (state(p), p.costs) for k, p in be.book.policies.items()})
            prompts.append(list(ids))
        return inner(ids, settings, speculative)

    be.generate = recording
    try:
        first = browser.new_page(viewport={"width": 1400, "height": 1000})
        first.goto(app.local_url)
        send(first, PROMPT, max_new=40)
        (key, pol), = be.book.policies.items()
        learnt, costs = state(pol), pol.costs
        assert "What the policy knows after this turn" in first.locator(".dfl-banner.done").inner_text()
        send(first, "shutil.copy" if TINY else "List five facts about the Moon.", max_new=40)    # its second turn
        other = browser.new_page(viewport={"width": 1400, "height": 1000})
        other.goto(app.local_url)
        send(other, PROMPT, max_new=40)                                                       # another visitor
    finally:
        be.generate = inner
    fresh = state(Policy(pol.block_size, costs.table, learn_costs=costs.learn))
    assert len(starts) == 3 and starts[0] in ({}, {key: (fresh, costs)}) and learnt != fresh
    assert starts[1] == starts[2] == {key: (fresh, costs)}                 # acceptance afresh, the costs kept
    first_ids, second_ids, other_ids = prompts                             # the page sends the conversation so far
    assert second_ids[:len(first_ids)] == first_ids and len(second_ids) > len(first_ids) and other_ids == first_ids


def slowed(generate, seconds: float, until):
    """The backend's generate with every round `seconds` slower while `until` (an Event) is not set: a turn long
    enough to send into, which runs at full speed once the test has seen what it waited for."""
    def slow(ids, settings, speculative=True):
        for r in generate(ids, settings, speculative):
            until.wait(seconds)
            yield r
    return slow


def test_browser_send_during_a_turn_keeps_the_prompt_and_empty_send_changes_nothing(app, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app.local_url)
    first = send(page, PROMPT, block="16", max_new=24)
    chat = page.locator("#dfl-chat").inner_text()
    spec = page.locator("#dfl-spec").inner_text()
    page.locator("#dfl-input textarea").fill("")
    page.locator("#dfl-send").click()                                           # empty: nothing changes
    page.locator("#dfl-message").get_by_text("the prompt is empty").wait_for(timeout=30_000)
    assert page.locator(".dfl-banner.done").inner_text() == first
    assert page.locator("#dfl-chat").inner_text() == chat and page.locator("#dfl-spec").inner_text() == spec

    box, button = page.locator("#dfl-input textarea"), page.locator("#dfl-send")
    be = app.handler.loaded.backend
    inner = be.generate
    seen = threading.Event()
    be.generate = slowed(inner, 0.25, seen)
    try:
        box.fill(PROMPT)
        box.press("Enter")                                                      # a long turn starts
        page.wait_for_function("() => document.querySelector('#dfl-send').disabled", timeout=60_000)
        nxt = "csv.reader" if TINY else "List five facts about the Moon."
        box.fill(nxt)
        box.press("Enter")                                                      # refused while the turn runs
        page.get_by_text("A turn is still running").first.wait_for(timeout=30_000)
        assert box.input_value() == nxt
        seen.set()                                                              # the rest of the turn at full speed
        page.wait_for_function("() => !document.querySelector('#dfl-send').disabled", timeout=300_000)
    finally:
        be.generate = inner
    assert box.input_value() == nxt                                             # the prompt is still there
    before = page.locator(".dfl-banner.done").inner_text()
    button.click()
    page.wait_for_function("b => { const d = document.querySelector('.dfl-banner.done'); return d && d.innerText !== b; }",
                           arg=before, timeout=300_000)
    assert nxt in page.locator("#dfl-chat").inner_text()
