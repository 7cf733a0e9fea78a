"""The page layout (gr.Blocks) and launching it: chat, the two live panels, the speedup, metrics, settings."""

from __future__ import annotations

import time

import gradio as gr

from ..benchmark import ratio
from . import render
from .handlers import ChatHandler
from .models import Loaded, ModelSpec, gpu_wrap, load, say
from .policy_view import SHARED
from .style import CSS

TITLE = "DFlash speculative decoding"
DEMO_EXAMPLES = ["pathlib.Path", "shutil.copy", "json.dumps", "textwrap.wrap"]   # the tiny target answers stdlib names with docstrings
# The SmolLM2 pair on a GPU, as docs/results.md measured it (a test checks every ratio a page shows is there).
GPU_DEMO = ("in the benchmark on an H100 this pair decodes 2.16× faster than plain AR with <i>auto</i> and 2.19× at block 8, one "
            "request at a time; on the example prompts below, where its drafter accepts less, the page measured a median 1.31×")
NO_RATIO = (f"when fewer than 1 round in {round(1 / ratio.MIN_DRAFTED_SHARE)} drafts, the page shows no ratio and "
            "says the answer decoded as plain AR (a ratio of two AR runs is noise).")
FOOTER = ("Requests run one at a time on the model. On a GPU the speculative run goes first, then AR; on a CPU the two "
          "take turns (lockstep: the one behind in the answer goes next), so the machine's load falls on both alike. "
          f"{SHARED} If someone else is generating you see your place in the queue. tok/s counts the time inside the "
          "decoder, prefill included.")
REAL_EXAMPLES = ["Explain speculative decoding to a ten-year-old in three sentences.",
                 "Write a Python function that checks whether a string is a palindrome.",
                 "List five facts about the Moon."]


def title_of(loaded: Loaded) -> str:
    """The page title names the backend that actually runs (ExLlamaV3 on a GPU, or PyTorch on the CPU)."""
    return f"{TITLE} on {loaded.engine}" if loaded.backend is not None else TITLE


def block_choices(native: int) -> list[tuple[str, str | int]]:
    """The block-size control: "auto" (the default, the drafting policy) and every fixed size 2..native."""
    return [("auto (the policy picks each round's block)", "auto")] + [(str(n), n) for n in range(max(native, 2), 1, -1)]


def header_html(loaded: Loaded) -> str:
    intro = ("A small <b>drafter</b> proposes a block of tokens in one pass; the <b>target</b> model checks the whole block "
             "in a single forward and keeps the longest prefix it agrees with, plus one token of its own. The text is "
             "exactly what the target alone would write (under greedy), produced in fewer target forwards.")
    demo = ""
    if loaded.demo and loaded.demo_kind == "smollm2":
        demo = smollm2_note(loaded)
    elif loaded.demo:
        demo = ('<div class="dfl-demo"><b>Demo on tiny models.</b> This page runs a 3-layer toy target (trained to answer a '
                "Python stdlib name such as <code>json.dumps</code> with its docstring) and a trained tiny DFlash drafter, on CPU. "
                "Expect docstring-like text, not a useful assistant; at this size drafting costs about as much as verifying, "
                "so with block size <i>auto</i> the policy drafts only where the drafter is right often enough and decodes "
                f"the rest as plain AR; {NO_RATIO} A fixed block size drafts every round. Look at the colours, τ and the "
                "measured speedup. For real models start it with "
                "<code>python app.py --target &lt;model&gt; --draft &lt;drafter&gt;</code> on a GPU.</div>")
    notes = "".join(render.message_html("info", n) for n in loaded.notes)
    models = (f'<div class="dfl-models">Backend <b>{render.esc(loaded.backend_name)}</b> on {render.esc(loaded.device)} · '
              f"target <code>{render.esc(loaded.target or '?')}</code> · drafter <code>{render.esc(loaded.draft or '?')}</code>"
              f" · native block {loaded.block_size} · context {loaded.max_context} · {render.esc(loaded.hardware.label())}</div>"
              if loaded.backend is not None else "")
    return f'<div class="dfl-hero"><h1>{render.esc(title_of(loaded))}</h1><p>{intro}</p>{demo}{notes}{models}</div>'


def smollm2_note(loaded: Loaded) -> str:
    """The SmolLM2 demo's banner: what runs where, and what to expect there."""
    head = ('<div class="dfl-demo"><b>Demo on a small real model.</b> This page runs SmolLM2-135M-Instruct (a '
            "135M-parameter chat model) with a DFlash drafter trained for it with this toolkit, ")
    if loaded.caps.gpu_only:
        return head + ("on the GPU with ExLlamaV3 (both zero-padded to its 128-aligned widths: the same outputs). "
                       f"Answers are those of a very small model; watch the speed: {GPU_DEMO}.</div>")
    where = "on the CPU (PyTorch)" if loaded.device == "cpu" else f"on {render.esc(loaded.device)} (PyTorch)"
    return head + (f"{where}. Answers are those of a very small model. On a CPU at this size the drafter and a "
                   "16-token verify cost several target steps, so with block size <i>auto</i> the drafting policy "
                   f"decodes mostly plain AR; {NO_RATIO} Pick a fixed block size to watch every round draft. "
                   f"On a GPU with ExLlamaV3, {GPU_DEMO}. For real models start it with "
                   "<code>python app.py --target &lt;model&gt; --draft &lt;drafter&gt;</code> on a GPU.</div>")


def build_app(loaded: Loaded) -> gr.Blocks:
    """The gr.Blocks page over an already loaded backend (or a load error, shown in the page)."""
    handler = ChatHandler(loaded)
    B = loaded.block_size
    with gr.Blocks(title=title_of(loaded)) as demo:
        gr.HTML(header_html(loaded))
        with gr.Row(equal_height=False):
            with gr.Column(scale=5):
                chat = gr.Chatbot(label="Chat — answered by DFlash speculative decoding", height=330, elem_id="dfl-chat",
                                  placeholder="Each answer sees the whole conversation (earlier turns and the system prompt).")
                with gr.Row():
                    box = gr.Textbox(show_label=False, placeholder="Type a prompt and press Enter…", scale=6, autofocus=True,
                                     elem_id="dfl-input", max_lines=6)
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="dfl-send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="dfl-stop")
                message = gr.HTML(render.message_html("error", loaded.error or ""), elem_id="dfl-message")
                gr.Examples(DEMO_EXAMPLES if loaded.demo_kind == "tiny" else REAL_EXAMPLES, inputs=box, label="Try one")
            with gr.Column(scale=3):
                with gr.Accordion("Settings", open=True):
                    block = gr.Dropdown(block_choices(B), value="auto", label=f"Block size B (drafter's native: {B})", elem_id="dfl-block",
                                        info="auto: a measured policy picks each round's block, plain AR where drafting "
                                             "does not pay; a number N: every round verifies the last token plus N-1 drafts")
                    max_new = gr.Slider(1, max(1, min(1024, loaded.max_context // 2)), value=min(128, loaded.max_context // 4),
                                        step=1, label="Max new tokens", elem_id="dfl-max-new")
                    temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="Temperature",
                                            info="0 = greedy: the two panels must be identical")
                    seed = gr.Number(0, precision=0, minimum=0, label="Seed (for temperature > 0)")
                    thinking = gr.Checkbox(False, label="Thinking mode", interactive=loaded.thinking,
                                           info="Qwen3.x chat templates; acceptance differs a lot between on and off"
                                           if loaded.thinking else "this target's chat template has no thinking switch")
                    system = gr.Textbox(label="System prompt", lines=2, placeholder="optional")
        banner = gr.HTML(render.banner_html("idle"), elem_id="dfl-banner")
        gr.HTML(render.legend_html())
        with gr.Row(equal_height=True):
            spec_html = gr.HTML(render.stream_html(render.Transcript(str), "DFlash speculative", "", False, True),
                                elem_id="dfl-spec")
            ar_html = gr.HTML(render.stream_html(render.Transcript(str), "Plain autoregressive (same target)", "", False, False),
                              elem_id="dfl-ar")
        with gr.Row(equal_height=True):
            with gr.Column(scale=1, min_width=180):
                tau = gr.HTML(render.tau_html(None, B), elem_id="dfl-tau")
            # min_width: on a narrow screen each plot takes a whole line rather than cutting its title
            acc = gr.BarPlot(render.acceptance_frame(None, B - 1), x="position", y="acceptance", y_lim=[0, 1], scale=2,
                             title="Acceptance by position", x_title="drafted position in the block",
                             y_title="share accepted", height=220, sort=[str(i) for i in range(1, B)], elem_id="dfl-acc",
                             min_width=300)
            hist = gr.BarPlot(render.histogram_frame(None, B), x="tokens", y="rounds", scale=2, height=220, y_lim=[0, 1],
                              title="Tokens per target forward", x_title="tokens emitted in the round",
                              y_title="rounds", sort=[str(i) for i in range(1, B + 1)], elem_id="dfl-hist",
                              min_width=300)
        with gr.Accordion("Every round: its block and drafted tokens, rejected tail struck through", open=False):
            blocks = gr.HTML(render.rounds_table_html(render.Transcript(str)), elem_id="dfl-blocks")
        result = gr.JSON(visible=False)   # the turn as data, for API clients: text, ar_text, tau, speedup, rounds, ...
        sent = gr.Textbox(visible=False, label="message")     # the message being answered (Send empties the box)
        # the earlier turns as the handler reads them: any JSON, so an API client's history is checked by the app
        history = gr.JSON([], visible=False, label="history")
        gr.Markdown(FOOTER)

        inputs = [sent, history, block, max_new, temperature, seed, system, thinking]
        outputs = [chat, box, banner, spec_html, ar_html, tau, blocks, acc, hist, message, result]
        fn = gpu_wrap(handler.respond, loaded.hardware)
        # preprocess=False: the handler gets the values as sent and checks them itself (app/turn.py), so a value the
        # page never sends is one sentence, not a Gradio traceback
        common = dict(fn=fn, inputs=inputs, outputs=outputs, concurrency_id="gpu", concurrency_limit=1,
                      show_progress_on=[banner], preprocess=False)
        # Send is disabled while this session's turn runs; Enter then says so and leaves the prompt in the box
        ui = dict(api_name=False, show_progress="hidden", concurrency_limit=None, concurrency_id="ui")   # no wait
        busy = dict(fn=handler.claim, inputs=box, outputs=[send, box, sent], **ui)
        free = dict(fn=handler.release, inputs=chat, outputs=[send, history], **ui)   # the chat becomes the history
        send.click(**busy).success(api_name="chat", **common).then(**free)
        box.submit(**busy).success(api_name=False, **common).then(**free)
        stop.click(handler.stop, None, message, queue=False, api_name="stop")
        chat.clear(lambda: [], None, history, **ui)
    demo.handler = handler
    return demo


def serve(demo: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, share: bool = False, block: bool = True,
          started: float | None = None):
    """Queue (one generation at a time, visible positions) and launch; block=False returns once it is up. With
    `started` (time.perf_counter() at the process start) the console says how long the page took."""
    demo.queue(default_concurrency_limit=1, max_size=64)
    demo.launch(server_name=host, server_port=port, share=share, css=CSS, prevent_thread_lock=True,
                show_error=False, quiet=True)       # gradio's own lines name launch(share=True); ours name --share
    if block or started is not None:
        when = f" {time.perf_counter() - started:.0f} s after the start" if started is not None else ""
        link = f"; public link {demo.share_url}" if share else " (python app.py --share also opens a public link)"
        say(f"page ready{when}: {demo.local_url}{link}")
    if block:
        demo.block_thread()
    return demo


def launch_app(target: str | None = None, draft: str | None = None, backend: str | None = None, device: str | None = None,
               host: str = "127.0.0.1", port: int | None = None, share: bool = False, defaults: dict | None = None,
               started: float | None = None) -> gr.Blocks:
    """Load the models (flags > env > `defaults` > embedded demo), build the page and serve it."""
    loaded = load(ModelSpec.resolve(target, draft, backend, device, defaults=defaults))
    return serve(build_app(loaded), host, port, share, started=started)
