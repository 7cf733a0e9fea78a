"""The app served in-process and driven through gradio_client: the real tiny pair, then queue, stop, faults."""

from __future__ import annotations

import html
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fakes import FakeBackend  # noqa: E402

pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402
from gradio_client.utils import Status  # noqa: E402

from toolkit.app.models import Hardware, Loaded, ModelSpec, load  # noqa: E402
from toolkit.app.ui import build_app, serve  # noqa: E402
from toolkit.benchmark import ratio  # noqa: E402

OUT = ["chat", "box", "banner", "spec", "ar", "tau", "blocks", "acc", "hist", "message", "result"]


def content(msg: dict) -> str:
    """A chat message's text (gradio 6 normalises content to a list of parts)."""
    c = msg["content"]
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)


def ask(client, prompt, max_new=24, block=16, temperature=0.0, api="/chat"):
    return dict(zip(OUT, client.predict(prompt, [], block, max_new, temperature, 0, "", False, api_name=api)))


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def real_app():
    loaded = load(ModelSpec(), Hardware())        # the embedded demo: the fixtures' trained tiny pair on CPU
    assert loaded.error is None, loaded.error
    demo = serve(build_app(loaded), block=False)
    yield demo
    demo.close()


@pytest.fixture(scope="module")
def fake_app():
    be = FakeBackend(step_s=0.02)
    demo = serve(build_app(Loaded(be, backend_name="fake", target="fake", draft="fake")), block=False)
    yield demo, be
    demo.close()


def test_chat_round_on_the_tiny_pair(real_app):
    out = ask(Client(real_app.local_url, verbose=False), "json.dumps", max_new=24)
    res = out["result"]
    assert res["text"] and res["text"] == content(out["chat"][-1]) and content(out["chat"][-2]) == "json.dumps"
    assert res["lossless"] and res["text"] == res["ar_text"] and len(res["tokens"]) == len(res["ar_tokens"])
    assert res["rounds"] and sum(len(r["drafted"][: r["accepted"]]) + 1 for r in res["rounds"]) == len(res["tokens"])
    assert res["tau"] >= 1 and res["tok_s"] > 0 and res["ar_tok_s"] > 0 and res["speedup"] > 0
    assert "×" in out["banner"] and "outputs identical" in out["banner"] and "τ" in html.unescape(out["tau"])
    assert 'class="tok ' in out["spec"] and "tok/s" in out["spec"] and "tok/s" in out["ar"]


def test_block_auto_on_the_tiny_pair(real_app):
    out = ask(Client(real_app.local_url, verbose=False), "json.dumps", max_new=24, block="auto")
    res = out["result"]
    assert res["block_size"] == "auto" and res["lossless"] and res["text"] == res["ar_text"]
    steps = [r for r in res["rounds"] if not r["prefill"]]
    assert all(r["proposed"] in (0, 15) and len(r["drafted"]) <= r["proposed"] for r in steps)
    banner = html.unescape(out["banner"])
    assert "block auto:" in banner and "block per round" in out["blocks"]
    drafted = sum(1 for r in steps if r["drafted"])    # a ratio only when enough rounds drafted, else none and why
    if drafted >= ratio.MIN_DRAFTED_ROUNDS and drafted >= ratio.MIN_DRAFTED_SHARE * len(steps):
        assert "×" in banner and res["speedup"] > 0
    else:
        assert "No speedup to report" in banner and "×" not in banner and res["speedup"] is None


def test_second_turn_sees_the_first_on_the_tiny_pair(real_app):
    be = real_app.handler.loaded.backend
    seen: list[tuple[bool, list[int]]] = []
    generate = be.generate

    def recording(ids, settings, speculative=True):
        seen.append((speculative, list(ids)))
        return generate(ids, settings, speculative)

    be.generate = recording
    try:
        client = Client(real_app.local_url, verbose=False)
        first = dict(zip(OUT, client.predict("json.dumps", [], 16, 16, 0.0, 0, "", False, api_name="/chat")))
        second = dict(zip(OUT, client.predict("pathlib.Path", first["chat"], 16, 16, 0.0, 0, "", False, api_name="/chat")))
    finally:
        del be.generate
    (s1, ids1), (a1, ar1), (s2, ids2), (a2, ar2) = seen
    assert (s1, a1, s2, a2) == (True, False, True, False) and ids1 == ar1 and ids2 == ar2
    assert ids2[: len(ids1)] == ids1 and len(ids2) > len(ids1)    # turn 2's prompt starts with all of turn 1's
    text = be.tokenizer.decode(ids2)
    answer = first["result"]["text"]
    assert text.index("json.dumps") < text.index(answer.strip()) < text.index("pathlib.Path")
    res = second["result"]
    assert res["lossless"] and res["text"] == res["ar_text"] and res["tokens"] == res["ar_tokens"]
    assert [content(m) for m in second["chat"]] == ["json.dumps", answer, "pathlib.Path", res["text"]]


def test_queue_shows_the_second_user_its_place(fake_app):
    demo, be = fake_app
    first = Client(demo.local_url, verbose=False).submit("hello", [], 16, 80, 0.0, 0, "", False, api_name="/chat")
    wait_for(lambda: first.status().code in (Status.PROCESSING, Status.ITERATING) or first.done())
    second = Client(demo.local_url, verbose=False).submit("hello", [], 16, 8, 0.0, 0, "", False, api_name="/chat")
    seen = set()
    deadline = time.time() + 60
    while not second.done() and time.time() < deadline:
        st = second.status()
        seen.add(st.code)
        if st.code == Status.IN_QUEUE:
            assert st.rank is not None and st.queue_size >= 1
        time.sleep(0.02)
    assert Status.IN_QUEUE in seen
    assert dict(zip(OUT, second.result()))["result"]["lossless"] and first.result()


def test_stop_really_stops(fake_app):
    demo, be = fake_app
    client = Client(demo.local_url, verbose=False)
    job = client.submit("hello", [], 16, 380, 0.0, 0, "", False, api_name="/chat")
    wait_for(lambda: len(job.outputs()) >= 2 or job.done())
    n_before = len([c for c in be.calls if c[0] == "generate"])
    client.predict(api_name="/stop")
    out = dict(zip(OUT, job.result()))
    assert "Stopped" in out["banner"]
    text = content(out["chat"][-1])
    assert 0 < len(text.split()) < 380                          # cut short, not the whole answer
    time.sleep(0.2)
    assert len([c for c in be.calls if c[0] == "generate"]) == n_before    # AR never started after the stop


def test_fault_is_a_message_and_the_server_keeps_serving(fake_app):
    demo, be = fake_app
    client = Client(demo.local_url, verbose=False)
    be.fail_at = 1
    try:
        bad = ask(client, "hello")
    finally:
        be.fail_at = None
    assert "ran out of memory" in bad["message"] and "Traceback" not in bad["message"]
    assert ask(client, "hello")["result"]["lossless"]
    empty = ask(client, "  ")
    assert "prompt is empty" in empty["message"]


def test_load_failure_page_still_serves():
    demo = serve(build_app(Loaded(None, error="Could not load the models: hidden_size: drafter has 64, target has 32")),
                 block=False)
    try:
        out = ask(Client(demo.local_url, verbose=False), "hello")
        assert "hidden_size: drafter has 64, target has 32" in out["message"]
    finally:
        demo.close()
