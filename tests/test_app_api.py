"""The chat app's API as a public surface: whatever a client sends to /chat is checked as the command line checks
its options (app/turn.py). A value the page never sends is one sentence (the page's message line, the result's
`error`) and one console line, never a traceback or a failure mid-answer; every history shape docs/app.md shows is
accepted, and a long one is cut to the context with a note. Hypothesis drives the handler with arbitrary values of
every field; the server is driven through gradio_client and raw HTTP (NaN and lone surrogates, which a JSON client
library cannot send)."""

from __future__ import annotations

import io
import json
import logging
import math
import urllib.request
from contextlib import redirect_stderr

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from app_fakes import OUT, FakeBackend
from toolkit.app.handlers import ChatHandler
from toolkit.app.models import Loaded
from toolkit.runtime.backend import GenSettings

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                   lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                   max_leaves=8)
ODD_CHARS = st.sampled_from(["\udcff", "\ud800", "\x00"])                      # lone surrogates and NUL
TEXT = st.text(st.one_of(st.characters(exclude_categories=[]), ODD_CHARS), max_size=12)


def mostly(good, bad, odds: int = 12):
    """`good`, or one time in `odds` `bad`: most examples reach the decoder, many with one hostile value."""
    return st.sampled_from([True] * (odds - 1) + [False]).flatmap(lambda ok: good if ok else bad)


WORD = st.text("abcdefgh ", min_size=1, max_size=12)
BAD_TEXT = st.one_of(st.builds(lambda a, c, b: a + c + b, WORD, ODD_CHARS, WORD), TEXT, ANY)
PART = st.one_of(WORD, st.fixed_dictionaries({"type": st.sampled_from(["text", "file"]), "text": WORD}), BAD_TEXT)
MESSAGE = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant"]), st.sampled_from(["system", "bot", 3])),
                                 "content": mostly(st.one_of(WORD, st.lists(PART, max_size=3)), BAD_TEXT, 40)})
TURNS = st.lists(mostly(st.one_of(MESSAGE, st.tuples(WORD, st.one_of(WORD, st.none()))), BAD_TEXT, 40),
                 max_size=8)
FIELDS = dict(message=mostly(WORD, BAD_TEXT), history=mostly(TURNS, ANY),
              block_size=mostly(st.sampled_from(["auto", "8", 16, 8.0, 2, 99, None]), st.one_of(st.integers(), ANY)),
              max_new_tokens=mostly(st.integers(1, 64), st.one_of(st.integers(), st.floats(), ANY)),
              temperature=mostly(st.floats(0, 100), st.one_of(st.floats(), st.integers(), ANY)),
              seed=mostly(st.integers(0, 2**63 - 1), st.one_of(st.integers(), st.floats(), ANY)),
              system=mostly(st.one_of(st.just(""), WORD), BAD_TEXT),
              thinking=mostly(st.booleans(), ANY))


def one_turn(h: ChatHandler, values: dict) -> tuple[list[dict], str, list[logging.LogRecord]]:
    """The handler's outputs for one request, the console (stderr) and what it logged."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("toolkit.app")
    log.addHandler(handler)
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            outs = [dict(zip(OUT, o)) for o in h.respond(*values.values())]
    finally:
        log.removeHandler(handler)
    return outs, err.getvalue(), records


@SETTINGS
@given(**FIELDS)
def test_the_handler_refuses_or_answers_whatever_a_client_sends(**values):
    be = FakeBackend(step_s=0, answer_len=12, max_context=96)          # a small context: long histories are cut
    outs, console, logged = one_turn(ChatHandler(Loaded(be)), values)
    assert outs and "Traceback" not in console and not logged, (console, logged)
    last = outs[-1]
    lines = console.strip().splitlines()
    assert len(lines) == 1, lines                                  # one console line per request, either way
    generated = [c[2] for c in be.calls if c[0] == "generate"]
    if "error" in last["result"]:                                  # refused: one sentence, before any decoding
        sentence = last["result"]["error"]
        assert len(outs) == 1 and not generated and lines[0] == f"[app] request refused: {sentence}"
        assert "\n" not in sentence and sentence.endswith(".") and "Generation failed" not in sentence
    else:                                                          # answered with values in their domains
        assert "text" in last["result"] and lines[0].startswith("[app] request: ") and generated
        assert all(isinstance(s, GenSettings) and 0 <= s.seed < 2**63 and math.isfinite(s.temperature)
                   for s in generated)
        json.dumps(last["result"], allow_nan=False)


@pytest.mark.parametrize("field,value,sentence", [
    ("seed", 1e30, "Seed must be from 0 to 9223372036854775807"),
    ("temperature", float("nan"), "Temperature must be a finite number, got nan."),
    ("message", "hi \udcff", "The message is not UTF-8 text: it holds a lone surrogate ('\\udcff')."),
    ("system", "be brief\x00", "The system prompt holds a NUL character"),
    ("max_new_tokens", 2.5, "Max new tokens must be a whole number, got 2.5."),
    ("block_size", 1, "Block size must be auto or a whole number from 2 to 16, got 1."),
    ("thinking", "yes", "Thinking mode must be true or false, got text."),
    ("history", ["hello", "world"], "The history's item 0 is text: each earlier turn is a message"),
    ("history", [{"role": "bot", "content": "x"}], "The history's message 0 has role 'bot'"),
])
def test_each_value_the_page_never_sends_is_one_sentence(field, value, sentence):
    values = dict(message="hello", history=[], block_size=16, max_new_tokens=8, temperature=0.0, seed=0, system="",
                  thinking=False) | {field: value}
    be = FakeBackend(step_s=0)
    outs, console, _ = one_turn(ChatHandler(Loaded(be)), values)
    assert len(outs) == 1 and outs[0]["result"]["error"].startswith(sentence) and sentence in console
    assert not [c for c in be.calls if c[0] == "generate"]


# --- through the server ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    pytest.importorskip("gradio_client")
    from toolkit.app.ui import build_app, serve

    demo = serve(build_app(Loaded(FakeBackend(step_s=0, answer_len=12), backend_name="fake", target="fake",
                                  draft="fake")), block=False)
    yield demo.local_url.rstrip("/")
    demo.close()


def raw_call(url: str, body: str) -> dict:
    """POST /chat with a JSON body as written (NaN, lone surrogate escapes) and read the last output set."""
    req = urllib.request.Request(f"{url}/gradio_api/call/chat", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    event = json.loads(urllib.request.urlopen(req, timeout=60).read())["event_id"]
    stream = urllib.request.urlopen(f"{url}/gradio_api/call/chat/{event}", timeout=60).read().decode()
    data = [line[5:] for line in stream.splitlines() if line.startswith("data:")]
    return dict(zip(OUT, json.loads(data[-1])))


HELLO = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]


@pytest.mark.parametrize("history,kept", [
    (HELLO, 2),                                                                     # content as plain text
    ([{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in HELLO], 2),   # text parts
    ([["hello", "hi there"]], 2),                                                   # [user, assistant] pairs
    ([{"role": "user" if i % 2 == 0 else "assistant", "content": "hello"} for i in range(600)], 600),
])
def test_every_documented_history_shape_is_accepted_and_a_long_one_is_cut(server, capfd, history, kept):
    from gradio_client import Client

    out = dict(zip(OUT, Client(server, verbose=False).predict("json.dumps", history, 16, 8, 0.0, 0, "", False,
                                                              api_name="/chat")))
    res = out["result"]
    assert "text" in res and len(out["chat"]) == kept + 2
    assert (res["history_dropped"] > 0) == (kept == 600)                           # 600 turns exceed 1024 tokens
    if kept == 600:
        assert "earlier messages were left out" in out["message"]
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("body,sentence", [
    ('{"data": ["hi", [], 16, 8, NaN, 0, "", false]}', "Temperature must be a finite number, got nan."),
    ('{"data": ["hi", [], 16, 8, Infinity, 0, "", false]}', "Temperature must be a finite number, got inf."),
    ('{"data": ["hi \\udcff", [], 16, 8, 0, 0, "", false]}', "The message is not UTF-8 text"),
    ('{"data": ["hi", [], 16, 8, 0, 1e30, "", false]}', "Seed must be from 0 to 9223372036854775807"),
    ('{"data": ["hi", [], 16, 8, "hot", 0, "", false]}', "Temperature must be a number, got 'hot'."),
    ('{"data": ["hi", [], 16, 1000000000, 0, 0, "", false]}', "exceeds the model's context of 1024"),
    ('{"data": ["hi", [], "x", 8, 0, 0, "", false]}', "Block size must be auto or a whole number"),
    ('{"data": ["hi", "not a list", 16, 8, 0, 0, "", false]}', "The history must be a list"),
])
def test_the_server_refuses_in_one_sentence_and_one_console_line(server, capfd, body, sentence):
    out = raw_call(server, body)
    err = capfd.readouterr().err
    assert out["result"]["error"].startswith(sentence) or sentence in out["result"]["error"], out["result"]
    assert "Traceback" not in err and [line for line in err.splitlines() if "request refused" in line]
