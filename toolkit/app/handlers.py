"""The chat handler: one generator that decodes speculatively, then plain AR, streaming both panels.

Both runs happen one after the other inside one call (and the GPU events share one concurrency id), so they
never skew each other. Timing counts only the time spent inside the backend's generator, not the UI updates.
Every failure becomes a visible message in the page; the server keeps serving. The console gets one line per
request: prompt tokens, rounds, the ratio or "plain AR", and whether it was stopped or its client left.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field
from typing import Iterator

import gradio as gr

from ..core.errors import ToolkitError
from ..runtime.backend import Backend, GenSettings, message_text
from ..runtime.events import Round, Speedup, Summary, round_speedup, summarize
from . import render
from .models import Loaded, say

log = logging.getLogger("toolkit.app")
UI_INTERVAL = 0.08      # seconds between live updates of the panels
PLOT_INTERVAL = 0.5     # seconds between live updates of the plots
FAILED = "⚠️ "          # the start of the chat reply of a turn that failed


@dataclass
class Run:
    """One decode of the prompt, timed inside the backend only."""

    backend: Backend
    ids: list[int]
    settings: GenSettings
    speculative: bool
    rounds: list[Round] = field(default_factory=list)
    seconds: float = 0.0
    stopped: bool = False

    def __post_init__(self) -> None:
        self.transcript = render.Transcript(self.backend.decode)

    def stream(self, stop: threading.Event) -> Iterator[Round]:
        it = self.backend.generate(self.ids, self.settings, speculative=self.speculative)
        try:
            while True:
                if stop.is_set():
                    self.stopped = True
                    return
                t0 = time.perf_counter()
                try:
                    r = next(it)
                except StopIteration:
                    return
                finally:
                    self.seconds += time.perf_counter() - t0
                self.rounds.append(r)
                self.transcript.add(r)
                yield r
        except GeneratorExit:       # the turn was cancelled (Stop, or the client left): no more rounds
            self.stopped = True
            raise
        finally:
            it.close()              # a stopped run ends the backend's generator (exllamav3 frees its jobs' pages)

    @property
    def tokens(self) -> list[int]:
        return [t for r in self.rounds for t in r.tokens]

    def summary(self) -> Summary:
        return summarize(self.rounds, self.seconds)


def histogram(s: Summary | None, block: int):
    """The histogram's data with a y-axis of at least 0..1 (an all-zero column would draw its axis as 0.000000)."""
    frame = render.histogram_frame(s, block)
    return gr.BarPlot(frame, y_lim=[0, max(1, int(frame["rounds"].max()))])


def speed_of(spec: Run, ar: Run) -> Speedup:
    """The turn's ratio with its spread over the rounds' timings; none when no round drafted."""
    return round_speedup(spec.rounds, ar.rounds, (spec.seconds, ar.seconds))


@dataclass
class View:
    """Everything the handler updates, in the order of ChatHandler.outputs."""

    chat: list
    banner: str
    spec: str
    ar: str
    tau: str
    blocks: str
    acc: object = None     # DataFrame or gr.skip()
    hist: object = None
    message: str = ""
    result: dict | None = None

    def values(self, clear_box: bool = False) -> tuple:
        skip = gr.skip()
        return (self.chat, "" if clear_box else skip, self.banner, self.spec, self.ar, self.tau, self.blocks,
                skip if self.acc is None else self.acc, skip if self.hist is None else self.hist, self.message,
                skip if self.result is None else self.result)


def friendly(e: BaseException) -> str:
    """One line for the page; never a traceback."""
    name = type(e).__name__
    text = str(e).splitlines()[0][:300] if str(e) else ""
    if "OutOfMemory" in name or "out of memory" in text.lower():
        return "The GPU ran out of memory. Try fewer max new tokens or a shorter prompt; the app keeps serving."
    if isinstance(e, ToolkitError):
        return text
    return f"Generation failed ({name}: {text}). The app keeps serving; try again or change the settings."


def result_json(spec: Run, ar: Run, block: int | str, thinking: bool | None) -> dict:
    """The turn as data (same keys as `python -m toolkit.generate --compare-ar --json` where they overlap)."""
    s = spec.summary()
    ar_tok_s = len(ar.tokens) / ar.seconds if ar.seconds > 0 else 0.0
    speed = speed_of(spec, ar) if not (spec.stopped or ar.stopped) else Speedup(None, "the run was stopped")
    return {
        "text": spec.transcript.text, "ar_text": ar.transcript.text, "tokens": spec.tokens, "ar_tokens": ar.tokens,
        "rounds": [r.to_json() for r in spec.rounds], "tau": s.tau, "accept_per_position": s.accept_per_position,
        "tau_histogram": {str(k): v for k, v in s.tau_histogram.items()}, "tok_s": s.tok_s, "ar_tok_s": ar_tok_s,
        "seconds": spec.seconds, "ar_seconds": ar.seconds, **speed.to_json(),
        "lossless": spec.tokens == ar.tokens, "block_size": block, "thinking": thinking, "stopped": ar.stopped,
    }


def policy_note(rounds: list[Round]) -> str:
    """What the drafting policy chose over a run: AR rounds and the widths of the speculative ones."""
    steps = [r for r in rounds if not r.prefill]
    spec = [len(r.drafted) for r in steps if r.drafted]
    if not steps:
        return ""
    if not spec:
        return f"block auto: all {len(steps)} rounds plain AR (drafting does not pay on this model and hardware)"
    blocks = sorted({w + 1 for w in spec})
    shown = ", ".join(map(str, blocks)) if len(blocks) <= 4 else f"{blocks[0]}–{blocks[-1]}"
    return (f"block auto: {len(spec)} of {len(steps)} rounds speculative (block {shown}), "
            f"{len(steps) - len(spec)} plain AR")


def history_messages(history) -> list[dict]:
    """The earlier turns as [{"role", "content": str}] for the chat template, oldest first.

    Only user and assistant text; empty messages are dropped, and so is a failed turn (the reply is the app's
    warning, not the model's) together with the user message it answered.
    """
    out: list[dict] = []
    for m in history or []:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            continue
        text = message_text(m.get("content"))
        if m["role"] == "assistant" and text.startswith(FAILED):
            if out and out[-1]["role"] == "user":
                out.pop()
            continue
        if text.strip():
            out.append({"role": m["role"], "content": text})
    return out


def free_gpu() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


class ChatHandler:
    """Holds the loaded models and one stop flag per browser session."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.stops: dict[str, threading.Event] = {}

    def _flag(self, request: gr.Request | None) -> threading.Event:
        key = getattr(request, "session_hash", None) or "default"
        return self.stops.setdefault(key, threading.Event())

    def stop(self, request: gr.Request = None) -> str:
        self._flag(request).set()
        return render.message_html("info", "Stopping…")

    def _idle(self, chat, message: str, kind: str = "error") -> View:
        b = self.loaded.block_size
        return View(chat, render.banner_html("idle"), render.stream_html(render.Transcript(str), "DFlash speculative", "", False, True),
                    render.stream_html(render.Transcript(str), "Plain autoregressive", "", False, False),
                    render.tau_html(None, b), render.rounds_table_html(render.Transcript(str)),
                    render.acceptance_frame(None, b - 1), histogram(None, b), render.message_html(kind, message))

    def _view(self, chat, spec: Run, ar: Run | None, state: str, plots: bool, block: int, mode: str, message: str = "") -> View:
        s = spec.summary()
        n_ar = sum(1 for r in spec.rounds if not r.prefill and not r.drafted)      # rounds the policy decoded as AR
        spec_rate = render.rate_html(len(spec.tokens), spec.seconds, s.rounds, s.tau if s.rounds else None)
        ar_rate = render.rate_html(len(ar.tokens), ar.seconds) if ar else "runs after the speculative pass"
        done_spec = state != "spec"
        banner = render.banner_html(
            state, (len(spec.tokens), spec.seconds), (len(ar.tokens), ar.seconds) if ar else None,
            identical=(ar is not None and spec.tokens == ar.tokens), greedy=spec.settings.temperature == 0, mode=mode,
            widths=policy_note(spec.rounds) if spec.settings.auto else "",
            speed=speed_of(spec, ar) if state == "done" else None)
        return View(
            chat, banner,
            render.stream_html(spec.transcript, "DFlash speculative", spec_rate, not done_spec, True),
            render.stream_html(ar.transcript if ar else render.Transcript(str), "Plain autoregressive (same target)", ar_rate,
                               state == "ar", False),
            render.tau_html(s, block, n_ar), render.rounds_table_html(spec.transcript),
            render.acceptance_frame(s, block - 1) if plots else None, histogram(s, block) if plots else None,
            message)

    def prefilling(self, chat, spec: Run, block: int, mode: str, n: int) -> View:
        """The first update of a turn: the user's message in the chat and what the model is doing."""
        view = self._view(chat, spec, None, "spec", True, block, mode,
                          render.message_html("info", f"Prefilling {n} prompt tokens…"))
        view.banner = f'<div class="dfl-banner run">Prefilling {n} prompt tokens{mode}…</div>'
        return view

    def respond(self, message, history, block_size, max_new_tokens, temperature, seed, system, thinking,
                request: gr.Request = None):
        """Stream one chat turn: speculative first, then plain AR on the same prompt (the whole conversation); one
        console line when it ends, however it ends."""
        turn: dict = {}
        how = "done"
        try:
            yield from self._respond(turn, message, history, block_size, max_new_tokens, temperature, seed, system,
                                     thinking, request)
        except GeneratorExit:          # Gradio closed the stream: the client left
            how = "client left"
            raise
        finally:
            if turn:
                say(request_line(turn, how))

    def _respond(self, turn: dict, message, history, block_size, max_new_tokens, temperature, seed, system, thinking,
                 request):
        chat = list(history or [])
        stop = self._flag(request)
        stop.clear()
        be = self.loaded.backend
        if be is None:
            yield self._idle(chat, self.loaded.error or "No model is loaded.").values()
            return
        text = (message or "").strip()
        if not text:
            yield self._idle(chat, "Type a message first: the prompt is empty.", "warn").values()
            return
        try:
            choice = GenSettings.parse_block(block_size or "auto")
            choice = choice if choice == "auto" else min(choice, be.block_size)
            settings = GenSettings(max_new_tokens=int(max_new_tokens), temperature=float(temperature or 0),
                                   seed=int(seed or 0), block_size=choice)
            block = settings.fixed_block(be.block_size)          # the widest block a round may verify: the plots' axes
            think = bool(thinking) if self.loaded.thinking else None
            turns = history_messages(chat) + [{"role": "user", "content": text}]
            # the whole conversation through the chat template; a first turn is passed as the plain message
            ids = be.encode(text if len(turns) == 1 else turns, system=(system or "").strip() or None, thinking=think)
            if len(ids) + settings.max_new_tokens > be.max_context:
                what = "prompt" if len(turns) == 1 else f"conversation ({len(turns)} messages)"
                raise ToolkitError(f"The {what} is {len(ids)} tokens; with {settings.max_new_tokens} new tokens that exceeds "
                                   f"the model's context of {be.max_context}. "
                                   + ("Shorten the prompt or lower max new tokens." if len(turns) == 1 else
                                      "Clear the chat, shorten the prompt or lower max new tokens."))
        except (ToolkitError, ValueError) as e:
            yield self._idle(chat, str(e)).values()
            return
        except Exception as e:  # the tokenizer or its chat template failed: a message, not a traceback
            log.exception("encoding the prompt failed")
            yield self._idle(chat, friendly(e)).values()
            return
        mode = "" if think is None else f" · thinking {'on' if think else 'off'}"
        chat += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        spec = Run(be, ids, settings, True)
        ar: Run | None = None
        turn.update(prompt=len(ids), block=choice, spec=spec)
        # the user's message shows at once: a long prompt's prefill comes before the first round
        yield self.prefilling(chat, spec, block, mode, len(ids)).values(clear_box=True)
        try:
            last = last_plot = 0.0
            # closing(): when Gradio closes this generator (Stop, or the client left) the backend's is closed too
            with closing(spec.stream(stop)) as rounds:
                for _ in rounds:
                    now = time.perf_counter()
                    if now - last >= UI_INTERVAL:
                        chat[-1] = {"role": "assistant", "content": spec.transcript.text}
                        plots = now - last_plot >= PLOT_INTERVAL
                        yield self._view(chat, spec, None, "spec", plots, block, mode).values()
                        last, last_plot = now, (now if plots else last_plot)
            chat[-1] = {"role": "assistant", "content": spec.transcript.text}
            if spec.stopped:
                yield self._view(chat, spec, None, "stopped", True, block, mode, render.message_html("info", "Stopped.")).values()
                return
            ar = turn["ar"] = Run(be, ids, settings, False)
            yield self._view(chat, spec, ar, "ar", True, block, mode).values()
            last = time.perf_counter()
            with closing(ar.stream(stop)) as rounds:
                for _ in rounds:
                    now = time.perf_counter()
                    if now - last >= UI_INTERVAL:
                        yield self._view(chat, spec, ar, "ar", False, block, mode).values()
                        last = now
            state = "stopped" if ar.stopped else "done"
            note = render.message_html("info", "Stopped.") if ar.stopped else ""
            view = self._view(chat, spec, ar, state, True, block, mode, note)
            view.result = result_json(spec, ar, choice, think)
            yield view.values()
        except Exception as e:  # OOM, backend errors: a visible message, never a traceback
            log.exception("generation failed")
            turn["failed"] = friendly(e)
            free_gpu()
            if chat and chat[-1]["role"] == "assistant" and not chat[-1]["content"]:
                chat[-1] = {"role": "assistant", "content": FAILED + friendly(e)}
            v = self._view(chat, spec, ar, "failed", True, block, mode, render.message_html("error", friendly(e)))
            yield v.values(clear_box=True)


def request_line(turn: dict, how: str) -> str:
    """The console line of one request: prompt tokens, rounds, the ratio or plain AR, and how it ended."""
    spec, ar = turn["spec"], turn.get("ar")
    steps = [r for r in spec.rounds if not r.prefill]
    drafted = sum(1 for r in steps if r.drafted)
    head = f"request: {turn['prompt']} prompt tokens, block {turn['block']}, {len(spec.tokens)} tokens in {len(steps)} rounds"
    if "failed" in turn:
        return f"{head}; failed: {turn['failed']}"
    if how == "client left" or spec.stopped or (ar is not None and ar.stopped):
        return f"{head}; {'the client left' if how == 'client left' else 'stopped'} before the end: no ratio"
    if ar is None:
        return f"{head}; ended before the plain AR run"
    speed = speed_of(spec, ar)
    if speed.value is None:
        return f"{head}, all plain AR (no round drafted): no ratio"
    return f"{head} ({drafted} drafted); {speed.text()}"
