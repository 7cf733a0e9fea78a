"""The app's pieces without a server: token origins and markup, backend choice, the streaming handler's paths."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

import gradio as gr
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_fakes import OUT, AutoFake, FakeBackend, run  # noqa: E402

from toolkit.app import render  # noqa: E402
from toolkit.app.handlers import ChatHandler  # noqa: E402
from toolkit.app.models import Hardware, Loaded, ModelSpec, choose_backend, gpu_wrap, load  # noqa: E402
from toolkit.core.errors import ToolkitError  # noqa: E402
from toolkit.runtime.events import Round  # noqa: E402

def text_of(panel: str) -> str:
    """The visible text of a stream panel (popups dropped)."""
    body = panel.split('class="dfl-stream">', 1)[1]
    body = re.sub(r'<span class="pop">.*?</span></span>', "</span>", body)   # popups hold nested spans: drop whole
    body = re.sub(r'<span class="pop">(?:(?!<span class="rnd").)*', "", body)
    return html.unescape(re.sub(r"<[^>]+>", "", body)).replace("▌", "")


def test_transcript_kinds_follow_the_rounds():
    be = FakeBackend()
    t = render.Transcript(be.decode)
    t.add(Round((), 0, 5, prefill=True))
    t.add(Round((6, 7, 8), 3, 9))          # full block: bonus
    t.add(Round((10, 11, 99), 2, 12))      # rejected at 2: correction
    t.add(Round((13, 14, 15), 1, 14))      # clipped by budget: the last emitted token is a drafted one
    kinds = [p.kind for v in t.rounds for p in v.pieces]
    assert kinds == ["target", "accepted", "accepted", "accepted", "bonus", "accepted", "accepted", "correction",
                     "accepted", "accepted"]
    assert t.text == be.decode([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    blk = render.block_html(t.rounds[2])
    assert '<s class="rej">' in blk and "→" in blk and render.esc(be.decode([99]).replace("\n", "⏎")) in blk


def test_token_texts_hold_back_split_utf8():
    data = "é✓".encode()
    tt = render.TokenTexts(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [tt.push(b) for b in data]
    assert "".join(pieces) == "é✓" and pieces[0] == "" and pieces[1] == "é"


def test_stream_html_escapes_model_text():
    t = render.Transcript(lambda ids: "<script>alert(1)</script>" if ids else "")
    t.add(Round((), 0, 1, prefill=True))
    out = render.stream_html(t, "x", "", False, True)
    assert "<script>" not in out and "&lt;script&gt;" in out


def test_plot_frames_have_every_position():
    from toolkit.runtime.events import summarize

    s = summarize([Round((), 0, 1, prefill=True), Round((1, 2, 3), 3, 4), Round((1, 2, 3), 1, 5)])
    acc = render.acceptance_frame(s, 3)
    assert list(acc["position"]) == ["1", "2", "3"] and list(acc["acceptance"]) == [1.0, 0.5, 0.5]
    hist = render.histogram_frame(s, 4)
    assert list(hist["rounds"]) == [0, 1, 0, 1]


def test_handler_streams_spec_then_ar_and_matches_under_greedy():
    h = ChatHandler(Loaded(FakeBackend(step_s=0.001), backend_name="fake"))
    outs = run(h, max_new=60)
    assert len(outs) >= 2
    gens = [c for c in h.loaded.backend.calls if c[0] == "generate"]
    assert [g[1] for g in gens] == [True, False]          # speculative first, then AR, in one call
    last = outs[-1]
    res = last["result"]
    assert res["lossless"] and res["tokens"] == res["ar_tokens"] and len(res["tokens"]) == 60
    assert res["text"] == res["ar_text"] == last["chat"][-1]["content"]
    assert text_of(last["spec"]) == text_of(last["ar"]) == res["text"]
    assert res["tau"] > 1 and res["speedup"] > 0 and "faster" in last["banner"] or "slower" in last["banner"]
    assert 'class="tok accepted"' in last["spec"] and 'class="tok correction"' in last["spec"]
    assert 'class="tok bonus"' in last["spec"]
    assert all(o["box"] == gr.skip() for o in outs)        # Send empties the box (claim), the turn leaves it alone


def test_handler_block_size_setting_reaches_the_backend():
    be = FakeBackend(step_s=0)
    res = run(ChatHandler(Loaded(be)), block=4)[-1]["result"]
    assert max(len(r["drafted"]) for r in res["rounds"]) == 3 and res["block_size"] == 4
    assert be.calls[-1][2].block_size == 4


@pytest.mark.parametrize("prompt,needle", [("   ", "empty"), ("x" * 1100, "exceeds the model's context")], ids=["empty", "long"])
def test_bad_prompts_are_messages(prompt, needle):
    h = ChatHandler(Loaded(FakeBackend(step_s=0)))
    outs = run(h, prompt=prompt, max_new=16)
    assert len(outs) == 1 and needle in html.unescape(outs[0]["message"]) and "Traceback" not in outs[0]["message"]
    assert not [c for c in h.loaded.backend.calls if c[0] == "generate"]


def test_oom_midway_is_a_message_and_the_next_turn_works():
    be = FakeBackend(step_s=0, fail_at=2)
    h = ChatHandler(Loaded(be))
    last = run(h)[-1]
    assert "ran out of memory" in last["message"] and "dfl-msg error" in last["message"]
    assert "did not finish" in last["banner"]
    be.fail_at = None
    assert run(h)[-1]["result"]["lossless"]


def test_unexpected_error_is_one_line():
    be = FakeBackend(step_s=0, fail_at=0, fault=KeyError("layers.3.mlp"))
    msg = run(ChatHandler(Loaded(be)))[-1]["message"]
    assert "KeyError" in msg and "keeps serving" in msg and "\n" not in msg.strip()


def test_no_model_shows_the_load_error():
    h = ChatHandler(Loaded(None, error="Could not load the models: target: boom"))
    out = run(h)[0]
    assert "Could not load the models: target: boom" in out["message"]


def test_stop_flag_ends_the_turn():
    be = FakeBackend(step_s=0)
    h = ChatHandler(Loaded(be, device="cuda"))                  # one run after the other (a GPU)
    gen = h.respond("hello", [], 16, 200, 0.0, 0, "", False)
    next(gen)                # the prefilling status
    next(gen)                # the first round
    produced = be.produced
    h.stop(None)
    rest = [dict(zip(OUT, o)) for o in gen]
    assert be.produced <= produced + 1 and be.closed == 1       # within one round; the backend's generator closed
    assert "Stopped" in rest[-1]["banner"] and "Stopped" in rest[-1]["message"]
    assert [c[1] for c in be.calls if c[0] == "generate"] == [True]      # AR never started


def test_long_prompt_shows_the_message_and_the_prefill_status_first():
    be = FakeBackend(step_s=0)
    h = ChatHandler(Loaded(be))
    prompt = "a long prompt " * 40
    n = len(be.encode(prompt.strip()))
    first = dict(zip(OUT, next(h.respond(prompt, [], 16, 20, 0.0, 0, "", False))))
    assert first["chat"][0] == {"role": "user", "content": prompt.strip()}
    assert f"Prefilling {n} prompt tokens" in first["banner"] and f"Prefilling {n} prompt tokens" in first["message"]
    assert first["box"] == gr.skip()                            # the box is Send's (claim), not the turn's
    assert be.produced == 0                                     # shown before the backend decodes anything


@pytest.mark.parametrize("updates", [1, 3])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_closing_the_turn_closes_the_backend_within_one_round(updates, device, monkeypatch):
    """A client that left (or a cancelled event): Gradio closes the handler's generator at its next update; on a
    CPU both runs (lockstep) are open and both are closed."""
    from toolkit.app import handlers

    monkeypatch.setattr(handlers, "UI_INTERVAL", 0.0)          # an update per round: deterministic, no timing
    be = FakeBackend(step_s=0)
    h = ChatHandler(Loaded(be, device=device))
    gen = h.respond("hello", [], 16, 380, 0.0, 0, "", False)
    for _ in range(updates):
        next(gen)
    produced = be.produced
    gen.close()
    runs = [True] if device == "cuda" else [True, False]
    assert be.closed == (len(runs) if updates > 1 else 0)       # no backend generator is left running
    assert be.produced <= produced + len(runs)
    assert [c[1] for c in be.calls if c[0] == "generate"] == (runs if updates > 1 else [])


def test_thinking_switch_only_where_the_template_has_it():
    be = FakeBackend(step_s=0)
    run(ChatHandler(Loaded(be)), thinking=True, system="be brief")
    assert be.calls[0] == ("encode", "hello", "be brief", None)
    be.tokenizer.chat_template = "{% if enable_thinking %}<think>{% endif %}"
    run(ChatHandler(Loaded(be)), thinking=True)
    assert ("encode", "hello", None, True) in be.calls


def test_choose_backend_falls_back_without_cuda():
    cpu = Hardware(cuda=False)
    assert choose_backend(ModelSpec(target="t", draft="d"), cpu)[:2] == ("torch", "cpu")
    name, dev, notes = choose_backend(ModelSpec(target="t", draft="d", backend="exllamav3"), cpu)
    assert (name, dev) == ("torch", "cpu") and "no CUDA GPU" in notes[0]
    name, _, notes = choose_backend(ModelSpec(target="t", draft="d", backend="exllamav3"), Hardware(cuda=True, zero_gpu=True))
    assert name == "torch" and "ZeroGPU" in notes[0]


def test_hardware_reads_space_env():
    hw = Hardware.detect({"SPACE_ID": "me/demo", "ACCELERATOR": "none"})
    assert hw.space_id == "me/demo" and not hw.cuda and not hw.zero_gpu and "Space me/demo" in hw.label()
    assert Hardware.detect({"SPACE_ID": "me/demo", "ACCELERATOR": "zero-a10g"}).zero_gpu
    assert Hardware.detect({"SPACES_ZERO_GPU": "true"}).zero_gpu


def test_model_spec_flags_beat_env():
    env = {"DFLASH_TARGET": "a/t", "DFLASH_DRAFT": "a/d", "DFLASH_BACKEND": "torch"}
    assert ModelSpec.resolve(env=env) == ModelSpec("a/t", "a/d", "torch", None)
    assert ModelSpec.resolve(target="x", env=env).target == "x" and ModelSpec.resolve(env={}).demo
    with pytest.raises(ToolkitError, match="backend"):
        ModelSpec.resolve(backend="vllm", env={})


def test_gpu_wrap_is_a_noop_off_zerogpu():
    def f(x):
        yield x

    assert gpu_wrap(f, Hardware()) is f


def test_load_failures_become_messages(tmp_path):
    bad = load(ModelSpec(target=str(tmp_path), draft=str(tmp_path)), Hardware())
    assert bad.backend is None and bad.error.startswith("Could not load the models:")
    offline = load(ModelSpec(target="nobody/none-such", draft="nobody/none-draft"), Hardware())
    assert offline.backend is None and "nobody/none-such" in offline.error
    nodraft = load(ModelSpec(target=str(tmp_path)), Hardware())
    assert "no drafter given" in nodraft.error


def test_mismatched_drafter_is_reported(tmp_path):
    import json

    from toolkit.assets.fixtures import tiny_pair

    target, draft = tiny_pair()
    cfg = json.loads((target / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))   # the drafter expects 64
    got = load(ModelSpec(target=str(tmp_path), draft=str(draft)), Hardware())
    assert got.backend is None and "hidden_size: drafter has 128, target has 32" in got.error
    out = run(ChatHandler(got))[0]
    assert got.error in html.unescape(out["message"])


class ChatFake(FakeBackend):
    """The scripted backend with a real chat template (the tiny pair's tokenizer) that records each prompt's ids."""

    def __init__(self, **kw):
        from transformers import AutoTokenizer

        from toolkit.assets.fixtures import tiny_pair

        super().__init__(tokenizer=AutoTokenizer.from_pretrained(str(tiny_pair()[0])), **kw)
        self.prompts: list[tuple[bool, list[int]]] = []

    def encode(self, prompt, system=None, thinking=None):
        from toolkit.runtime.backend import encode_chat

        self.calls.append(("encode", prompt, system, thinking))
        return encode_chat(self.tokenizer, prompt, system, thinking)

    def generate(self, prompt_ids, settings, speculative=True):
        self.prompts.append((speculative, list(prompt_ids)))
        return super().generate(prompt_ids, settings, speculative)


def gradio_history(chat: list) -> list:
    """The chat as gradio 6 hands it back to the handler: content normalised to a list of text parts."""
    return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}], "metadata": None, "options": None}
            for m in chat]


def test_second_turn_sends_the_whole_conversation():
    be = ChatFake(step_s=0, answer_len=12)
    h = ChatHandler(Loaded(be))
    first = [dict(zip(OUT, o)) for o in h.respond("json.dumps", [], 16, 20, 0.0, 0, "be brief", False)][-1]
    answer = first["result"]["text"]
    assert answer and first["chat"][-1]["content"] == answer
    (_, ids1), (_, ar1) = be.prompts
    assert ids1 == ar1
    second = [dict(zip(OUT, o)) for o in h.respond("pathlib.Path", gradio_history(first["chat"]), 16, 20, 0.0, 0,
                                                   "be brief", False)][-1]
    (spec, ids2), (ar, ar2) = be.prompts[2:]
    assert (spec, ar) == (True, False) and ids2 == ar2            # both runs decode the same, whole conversation
    assert ids2[: len(ids1)] == ids1 and len(ids2) > len(ids1)    # the first turn's prompt is a prefix of the second's
    text = be.tokenizer.decode(ids2)
    assert text.index("be brief") < text.index("json.dumps") < text.index(answer) < text.index("pathlib.Path")
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>user") == 2
    res = second["result"]
    assert res["lossless"] and res["tokens"] == res["ar_tokens"] and res["text"] == res["ar_text"]
    assert [m["role"] for m in second["chat"]] == ["user", "assistant"] * 2 and second["chat"][-1]["content"] == res["text"]


def test_failed_turn_is_not_sent_and_a_long_conversation_loses_its_oldest_turns():
    be = ChatFake(step_s=0, max_context=300)
    h = ChatHandler(Loaded(be))
    failed = [{"role": "user", "content": "json.dumps"}, {"role": "assistant", "content": "⚠️ The GPU ran out of memory."}]
    [dict(zip(OUT, o)) for o in h.respond("pathlib.Path", gradio_history(failed), 16, 8, 0.0, 0, "", False)]
    assert be.calls[0] == ("encode", "pathlib.Path", None, None)     # nothing left of the failed turn: a first turn
    long = [{"role": "user", "content": "json.dumps"}, {"role": "assistant", "content": "speculative decoding " * 80},
            {"role": "user", "content": "shutil.copy"}, {"role": "assistant", "content": "copies a file"}]
    assert len(be.encode("pathlib.Path")) + 16 < 300                 # the new message alone would fit
    outs = [dict(zip(OUT, o)) for o in h.respond("pathlib.Path", gradio_history(long), 16, 16, 0.0, 0, "", False)]
    last = outs[-1]
    sent = be.tokenizer.decode(be.prompts[-1][1])
    assert "shutil.copy" in sent and "json.dumps" not in sent and len(be.prompts[-1][1]) + 16 <= 300
    assert last["result"]["history_dropped"] == 2 and len(last["chat"]) == 6      # the page still shows every turn
    assert "The oldest 2 earlier messages were left out" in html.unescape(last["message"])


def test_history_shapes_take_text_parts_and_pairs():
    from toolkit.app.turn import prompt_messages, read_history

    hist = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "file", "file": {"path": "x.png"}}]},
            {"role": "assistant", "content": "b"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]}]
    shown, skipped = read_history(hist)
    assert skipped == 0 and prompt_messages(shown) == [{"role": "user", "content": "a"},
                                                       {"role": "assistant", "content": "b"},
                                                       {"role": "user", "content": "c\nd"}]
    assert read_history([["a", "b"], ["c", None]])[0] == [{"role": "user", "content": "a"},
                                                         {"role": "assistant", "content": "b"},
                                                         {"role": "user", "content": "c"}]
    assert prompt_messages([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "a"},
                            {"role": "user", "content": "b"}]) == [{"role": "user", "content": "a\n\nb"}]
    be = FakeBackend(step_s=0)                          # a history ending with a message of the user's: joined
    outs = [dict(zip(OUT, o)) for o in ChatHandler(Loaded(be)).respond("new", [{"role": "user", "content": "a"}], 16,
                                                                       8, 0.0, 0, "", False)]
    assert "text" in outs[-1]["result"] and be.calls[0][1] == [{"role": "user", "content": "a\n\nnew"}]


def test_a_failing_chat_template_is_a_message():
    class Broken(FakeBackend):
        def encode(self, prompt, system=None, thinking=None):
            raise TypeError("can only concatenate str (not \"list\") to str")

    h = ChatHandler(Loaded(Broken(step_s=0)))
    outs = [dict(zip(OUT, o)) for o in h.respond("again", [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "yo"}], 16, 8, 0.0, 0, "", False)]
    assert len(outs) == 1 and "TypeError" in outs[0]["message"] and "chat template failed" in outs[0]["message"]
    assert outs[0]["result"]["error"].startswith("The target's tokenizer or chat template failed")


def test_auto_block_shows_the_width_of_every_round():
    be = AutoFake(step_s=0)
    outs = run(ChatHandler(Loaded(be)), block="auto", max_new=60)
    last = outs[-1]
    res = last["result"]
    assert res["block_size"] == "auto" and be.calls[1][2].auto and res["lossless"]
    ws = [len(r["drafted"]) for r in res["rounds"] if not r["prefill"]]
    assert set(ws) == {0, 3, 5, 15} and all(r["proposed"] == (15 if r["drafted"] else 0) for r in res["rounds"])
    blocks = html.unescape(last["blocks"])
    assert "block per round: 1 (AR) × " in blocks and "block 6 (5 drafted of 15 proposed): 2/5 accepted" in blocks
    assert "block 16 (15 drafted): 2/15 accepted" in blocks                       # the block τ counts up to
    assert "rounds 1–3: block 1, plain AR (the policy found drafting not worth it) → 3 tokens" in blocks
    n_ar = ws.count(0)
    assert f"{n_ar} plain AR rounds (block 1)" in html.unescape(last["tau"])
    assert f"block auto: {len(ws) - n_ar} of {len(ws)} rounds speculative (block 4, 6, 16), {n_ar} plain AR" in html.unescape(last["banner"])
    assert "×" in last["banner"] and res["speedup"] > 0 and res["speedup_reason"] is None   # it drafted: a ratio
    assert res["speedup_spread"] is None and "no spread measured" in html.unescape(last["banner"])  # untimed rounds
    assert text_of(last["spec"]) == text_of(last["ar"]) == res["text"]


def test_block_control_offers_auto_first_then_fixed_sizes():
    from toolkit.app.ui import block_choices

    values = [v for _, v in block_choices(16)]
    assert values == ["auto"] + list(range(16, 1, -1))
    be = FakeBackend(step_s=0)
    assert run(ChatHandler(Loaded(be)), block="8")[-1]["result"]["block_size"] == 8 and be.calls[-1][2].block_size == 8
    assert run(ChatHandler(Loaded(be)), block=None)[-1]["result"]["block_size"] == "auto"
    bad = run(ChatHandler(Loaded(be)), block="fast")
    assert len(bad) == 1 and "Block size must be auto or a whole number from 2 to 16, got 'fast'" in html.unescape(
        bad[0]["message"])


def test_all_ar_auto_run_says_so():
    be = AutoFake(step_s=0)
    be.widths = (0,)
    last = run(ChatHandler(Loaded(be)), block="auto", max_new=20)[-1]
    banner = html.unescape(last["banner"])
    assert "block auto: all 19 rounds plain AR" in banner
    assert "rounds 1–19: block 1" in html.unescape(last["blocks"])
    # no ratio next to "all rounds plain AR": the two runs decoded the same way
    assert "No speedup to report" in banner and "×" not in banner and "faster" not in banner and "slower" not in banner
    res = last["result"]
    assert res["speedup"] is None and "plain AR" in res["speedup_reason"] and res["speedup_spread"] is None


@pytest.mark.parametrize("cached", [False, True])
def test_first_start_says_it_prepares_the_demo_target(cached, tmp_path, capsys):
    from types import SimpleNamespace

    from toolkit.app.models import prepare_demo

    calls = []
    fake = SimpleNamespace(TARGET_NAME="t", cache_root=lambda: tmp_path, complete=lambda f: {"files": {}} if cached else None,
                           default_pair=lambda: calls.append(1) or (tmp_path / "t", tmp_path / "d"))
    assert prepare_demo(fake) == (tmp_path / "t", tmp_path / "d") and calls == [1]
    err = capsys.readouterr().err.splitlines()
    if cached:
        assert err == []                                        # a reused conversion: nothing to announce
    else:
        assert len(err) == 1 and "prepare: first start, converting the demo target SmolLM2-135M-Instruct" in err[0]
