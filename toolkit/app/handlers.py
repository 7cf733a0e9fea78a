"""The chat handler: one generator that decodes speculatively and plain AR, streaming both panels.

On a GPU the two runs happen one after the other inside one call (and the GPU events share one concurrency id),
so they never skew each other. On a CPU, where the machine's load moves a run's speed more than drafting does,
they run in lockstep, one round of each in turn, so the load falls on both alike (benchmark/lockstep.py). Timing
counts only the time spent inside the backend's generator, not the UI updates. Every turn starts its acceptance
from the state the start-up left, with the round costs of every turn so far (policy_view.SHARED). What a request
holds is checked first (turn.py): a refused one is one sentence in the page, the result's `error` for an API client
and one console line. Every failure becomes a visible message in the page; the server keeps serving. The console
gets one line per request: prompt tokens, rounds, the ratio or "plain AR", and whether it was stopped or its
client left.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import closing
from dataclasses import dataclass

import gradio as gr

from ..benchmark import lockstep
from ..core.cli import valid_text
from ..core.errors import ToolkitError
from ..runtime.events import Summary
from . import render
from .models import Loaded, say
from .policy_view import learnt, learnt_text
from .runs import Run, policy_note, request_line, result_json, speed_of
from .turn import FAILED, dropped_note, fit, read_turn

log = logging.getLogger("toolkit.app")
UI_INTERVAL = 0.08      # seconds between live updates of the panels
PLOT_INTERVAL = 0.5     # seconds between live updates of the plots


def histogram(s: Summary | None, block: int):
    """The histogram's data with a y-axis of at least 0..1 (an all-zero column would draw its axis as 0.000000)."""
    frame = render.histogram_frame(s, block)
    return gr.BarPlot(frame, y_lim=[0, max(1, int(frame["rounds"].max()))])


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

    def values(self) -> tuple:
        skip = gr.skip()                       # the box: Send emptied it already (ChatHandler.claim)
        return (self.chat, skip, self.banner, self.spec, self.ar, self.tau, self.blocks,
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


def free_gpu() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


class ChatHandler:
    """Holds the loaded models, one stop flag and one busy mark per browser session."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.stops: dict[str, threading.Event] = {}
        self.busy: set[str] = set()          # sessions with a turn sent and not yet finished

    @staticmethod
    def _key(request: gr.Request | None) -> str:
        return getattr(request, "session_hash", None) or "default"

    def _flag(self, request: gr.Request | None) -> threading.Event:
        return self.stops.setdefault(self._key(request), threading.Event())

    def stop(self, request: gr.Request = None) -> str:
        self._flag(request).set()
        return render.message_html("info", "Stopping…")

    def claim(self, message: str, request: gr.Request = None):
        """Before a turn: refuse a second one while this session's turn runs (the prompt stays in the box), else
        mark the session busy, disable Send and move the message out of the box (the next one may be typed at
        once, even while the turn waits in the queue). Outputs: Send, the box, the message being answered."""
        key = self._key(request)
        if key in self.busy:
            raise gr.Error("A turn is still running: wait for it to finish (or press Stop); your prompt stays in the box.",
                           duration=5, print_exception=False)
        self.busy.add(key)
        return gr.update(interactive=False), "", message

    def release(self, chat=None, request: gr.Request = None):
        """After a turn, however it ended: Send works again, and the chat as it now stands is the next turn's
        history."""
        self.busy.discard(self._key(request))
        return gr.update(interactive=True), chat or []

    def _refuse(self, message: str, kind: str = "error", text: str = "") -> tuple:
        """A turn refused before decoding: the message line says why in one sentence (and the refused prompt `text`
        goes back into the box); the chat and the panels stay. An API client reads the sentence as the result's
        `error`; the console gets one line."""
        say(f"request refused: {message}")
        skip = gr.skip()
        return (skip, text or skip) + (skip,) * 7 + (render.message_html(kind, message), {"error": message})

    def _view(self, chat, spec: Run, ar: Run | None, state: str, plots: bool, block: int, mode: str, message: str = "",
              paired: bool = False) -> View:
        """state: spec | ar (one after the other), both (lockstep), done | stopped | failed."""
        s = spec.summary()
        n_ar = sum(1 for r in spec.rounds if not r.prefill and not r.drafted)      # rounds the policy decoded as AR
        spec_rate = render.rate_html(len(spec.tokens), spec.seconds, s.rounds, s.tau if s.rounds else None)
        ar_rate = render.rate_html(len(ar.tokens), ar.seconds) if ar else "waiting for its turn"
        live = state in ("spec", "ar", "both")
        done = state == "done"
        policy = learnt_text(learnt(spec.backend, spec.settings)) if done else ""
        banner = render.banner_html(
            state, (len(spec.tokens), spec.seconds), (len(ar.tokens), ar.seconds) if ar else None,
            identical=(ar is not None and spec.tokens == ar.tokens), greedy=spec.settings.temperature == 0, mode=mode,
            widths=policy_note(spec.rounds) if spec.settings.auto else "",
            speed=speed_of(spec, ar) if done else None, paired=paired, policy=policy)
        return View(
            chat, banner,
            render.stream_html(spec.transcript, "DFlash speculative", spec_rate, live and state != "ar", True),
            render.stream_html(ar.transcript if ar else render.Transcript(str), "Plain autoregressive (same target)", ar_rate,
                               live and state != "spec", False),
            render.tau_html(s, block, n_ar), render.rounds_table_html(spec.transcript),
            render.acceptance_frame(s, block - 1) if plots else None, histogram(s, block) if plots else None,
            message)

    def prefilling(self, chat, spec: Run, block: int, mode: str, n: int, note: str = "") -> View:
        """The first update of a turn: the user's message in the chat and what the model is doing (and `note`: the
        earlier messages left out to fit the context)."""
        view = self._view(chat, spec, None, "spec", True, block, mode,
                          render.message_html("info", f"Prefilling {n} prompt tokens… {note}".strip()))
        view.banner = f'<div class="dfl-banner run">Prefilling {n} prompt tokens{mode}…</div>'
        return view

    def respond(self, message, history, block_size, max_new_tokens, temperature, seed, system, thinking,
                request: gr.Request = None):
        """Stream one chat turn: speculative and plain AR on the same prompt (the whole conversation); one console
        line when it ends, however it ends."""
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
        stop = self._flag(request)
        stop.clear()
        be = self.loaded.backend
        back = message if isinstance(message, str) and valid_text(message) else ""      # what goes back into the box
        if be is None:
            yield self._refuse(self.loaded.error or "No model is loaded.", text=back)
            return
        try:
            t = read_turn(message, history, block_size, max_new_tokens, temperature, seed, system, thinking,
                          native=be.block_size, can_think=self.loaded.thinking)
            if not t.text:
                yield self._refuse("Type a message first: the prompt is empty.", "warn")
                return
            ids = fit(be, t)
        except ToolkitError as e:                      # Refused too: a value of the request, in one sentence
            yield self._refuse(str(e), text=back.strip())
            return
        except Exception as e:  # the tokenizer or its chat template failed: one sentence, one console line
            why = (str(e).splitlines() or [""])[0][:200]
            yield self._refuse(f"The target's tokenizer or chat template failed on this conversation "
                               f"({type(e).__name__}: {why}).", text=back.strip())
            return
        settings, choice, think, chat = t.settings, t.choice, t.thinking, list(t.shown)
        block = settings.fixed_block(be.block_size)          # the widest block a round may verify: the plots' axes
        note = dropped_note(t, be.max_context)
        if self.loaded.policy_start is not None:
            self.loaded.policy_start.restore(be)       # acceptance afresh, the round costs carried (SHARED)
        mode = "" if think is None else f" · thinking {'on' if think else 'off'}"
        chat += [{"role": "user", "content": t.text}, {"role": "assistant", "content": ""}]
        spec = Run(be, ids, settings, True)
        ar: Run | None = Run(be, ids, settings, False) if self.loaded.lockstep else None
        turn.update(prompt=len(ids), block=choice, spec=spec, ar=ar, dropped=t.dropped)
        # the user's message shows at once: a long prompt's prefill comes before the first round
        yield self.prefilling(chat, spec, block, mode, len(ids), note).values()
        args = (chat, spec, block, mode)
        try:
            if ar is not None:
                yield from self._lockstep(*args, ar, stop)
            else:
                ar = yield from self._one_then_other(*args, stop, turn)
            if spec.stopped or ar is None or ar.stopped:
                yield self._view(chat, spec, ar, "stopped", True, block, mode, render.message_html("info", "Stopped."),
                                 paired=self.loaded.lockstep).values()
                return
            view = self._view(chat, spec, ar, "done", True, block, mode, render.message_html("info", note) if note else "",
                              paired=self.loaded.lockstep)
            view.result = result_json(spec, ar, choice, think, self.loaded.lockstep, learnt(be, settings)) | {
                "history_dropped": t.dropped}
            yield view.values()
        except Exception as e:  # OOM, backend errors: a visible message, never a traceback
            log.exception("generation failed")
            turn["failed"] = friendly(e)
            free_gpu()
            if chat and chat[-1]["role"] == "assistant" and not chat[-1]["content"]:
                chat[-1] = {"role": "assistant", "content": FAILED + friendly(e)}
            v = self._view(chat, spec, ar, "failed", True, block, mode, render.message_html("error", friendly(e)))
            yield v.values()

    def _lockstep(self, chat, spec: Run, block: int, mode: str, ar: Run, stop: threading.Event):
        """Both runs, one round of each in turn (a CPU: the machine's load falls on both alike)."""
        last = last_plot = 0.0
        # closing(): when Gradio closes this generator (Stop, or the client left) the backends' are closed too
        with closing(lockstep.alternate({"spec": spec.stream(stop), "ar": ar.stream(stop)})) as rounds:
            for _ in rounds:
                now = time.perf_counter()
                if now - last >= UI_INTERVAL:
                    chat[-1] = {"role": "assistant", "content": spec.transcript.text}
                    plots = now - last_plot >= PLOT_INTERVAL
                    yield self._view(chat, spec, ar, "both", plots, block, mode, paired=True).values()
                    last, last_plot = now, (now if plots else last_plot)
        chat[-1] = {"role": "assistant", "content": spec.transcript.text}

    def _one_then_other(self, chat, spec: Run, block: int, mode: str, stop: threading.Event, turn: dict):
        """Speculative, then plain AR (a GPU); returns the AR run (None when the speculative one was stopped)."""
        last = last_plot = 0.0
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
            return None
        ar = turn["ar"] = Run(spec.backend, spec.ids, spec.settings, False)
        yield self._view(chat, spec, ar, "ar", True, block, mode).values()
        last = time.perf_counter()
        with closing(ar.stream(stop)) as rounds:
            for _ in rounds:
                now = time.perf_counter()
                if now - last >= UI_INTERVAL:
                    yield self._view(chat, spec, ar, "ar", False, block, mode).values()
                    last = now
        return ar
