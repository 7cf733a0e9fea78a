"""HTML and plot data for the app: coloured tokens per round, the speedup banner, the metrics plots.

Everything here is pure (no gradio): the handler feeds it Rounds and token texts and puts the strings and
DataFrames into the page, so the tests can check the markup without a server.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable

from ..runtime.events import Round, Speedup, Summary, ar_verdict

# Token origins, in the order of the legend.
KINDS = {
    "accepted": "drafted, accepted by the target",
    "correction": "target's correction (draft rejected)",
    "bonus": "bonus token (whole draft accepted)",
    "target": "target token (prefill / plain AR)",
}


class TokenTexts:
    """Incremental detokenizer: the text each new token adds, holding back incomplete UTF-8 sequences."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0   # start of the small window that is re-decoded
        self.read = 0     # ids before this have had their text handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if now.endswith("\ufffd"):           # a multi-byte character split over tokens: wait for the rest
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]


@dataclass
class Piece:
    text: str
    kind: str


@dataclass
class RoundView:
    """One round as the page shows it: the emitted pieces and the whole drafted block."""

    index: int
    pieces: list[Piece]
    drafted: list[str]     # text of every verified drafted id: the round's width w = len(drafted)
    accepted: int          # leading drafted ids that were emitted
    prefill: bool = False
    proposed: int = 0      # ids the drafter proposed (B-1 under the auto policy, whatever w; 0 in AR rounds)

    @property
    def ar(self) -> bool:
        """A plain AR round of a speculative run (the policy chose width 0)."""
        return not self.prefill and not self.drafted


@dataclass
class Transcript:
    """The emitted tokens of one decode, grouped by round, with their origins."""

    decode: Callable[[list[int]], str]
    rounds: list[RoundView] = field(default_factory=list)
    texts: TokenTexts | None = None

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.decode)

    def add(self, r: Round) -> RoundView:
        toks = r.tokens
        n_acc = r.accepted
        clipped = r.accepted < len(r.drafted) and r.bonus == r.drafted[r.accepted]  # cut by stop/budget
        kinds = ["accepted"] * n_acc
        if r.prefill or not r.drafted:
            kinds.append("target")
        elif clipped:
            kinds.append("accepted")
            n_acc += 1
        else:
            kinds.append("bonus" if r.full else "correction")
        pieces = [Piece(self.texts.push(t), k) for t, k in zip(toks, kinds)]
        drafted = [self.decode([t]) for t in r.drafted]
        view = RoundView(len(self.rounds), pieces, drafted, n_acc, r.prefill, r.proposed or 0)
        self.rounds.append(view)
        return view

    @property
    def text(self) -> str:
        return "".join(p.text for v in self.rounds for p in v.pieces)

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for v in self.rounds:
            for p in v.pieces:
                out[p.kind] += 1
        return out


def esc(s: str) -> str:
    return html.escape(s, quote=True)


def visible(s: str) -> str:
    """Token text for the compact block view: newlines and tabs shown as symbols."""
    return esc(s.replace("\n", "⏎").replace("\t", "⇥")) or "&#8203;"


def _piece(p: Piece) -> str:
    return f'<span class="tok {p.kind}">{esc(p.text)}</span>'


def block_html(v: RoundView) -> str:
    """The drafted block of one round: emitted drafts, then the rejected tail struck through."""
    if not v.drafted:
        return '<span class="blk-note">no draft (prefill: the target picks the first token)</span>' if v.prefill else ""
    kept = "".join(f'<span class="tok accepted">{visible(t)}</span>' for t in v.drafted[: v.accepted])
    tail = "".join(visible(t) for t in v.drafted[v.accepted :])
    rej = f'<s class="rej">{tail}</s>' if tail else ""
    last = v.pieces[-1]
    fix = "" if last.kind == "accepted" else f' → <span class="tok {last.kind}">{visible(last.text)}</span>'
    return f"{kept}{rej}{fix}"


def tokens_text(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def width_text(v: RoundView) -> str:
    """The block a round verified (its drafted ids + the last token: what τ counts up to), and what the drafter
    proposed when that was more (the auto policy)."""
    w = len(v.drafted)
    of = f" of {v.proposed} proposed" if v.proposed > w else ""
    return f"block {w + 1} ({w} drafted{of})"


def round_caption(v: RoundView) -> str:
    if v.prefill:
        return f"round {v.index}: prefill"
    if not v.drafted:
        return f"round {v.index}: block 1, plain AR step (no draft) → {tokens_text(len(v.pieces))}"
    last = v.pieces[-1].kind
    how = {"bonus": "all accepted + bonus", "correction": "then corrected", "accepted": "cut at stop/budget"}[last]
    return f"round {v.index}: {width_text(v)}: {v.accepted}/{len(v.drafted)} accepted, {how} → {tokens_text(len(v.pieces))}"


def stream_html(t: Transcript, title: str, rate: str, live: bool, speculative: bool) -> str:
    """A panel: heading with tok/s, then the text, each round hoverable to show its drafted block."""
    parts = []
    for v in t.rounds:
        inner = "".join(_piece(p) for p in v.pieces)
        if speculative and v.drafted:
            pop = f'<span class="pop"><b>{esc(round_caption(v))}</b><br>{block_html(v)}</span>'
            parts.append(f'<span class="rnd" tabindex="0">{inner}{pop}</span>')
        else:
            parts.append(inner)
    cursor = '<span class="cursor">▌</span>' if live else ""
    body = "".join(parts) or '<span class="placeholder">waiting for a prompt…</span>'
    kind = "spec" if speculative else "ar"
    return (f'<div class="dfl-panel {kind}"><div class="dfl-head"><span class="dfl-title">{esc(title)}</span>'
            f'<span class="dfl-rate">{rate}</span></div><div class="dfl-stream">{body}{cursor}</div></div>')


def ar_run_caption(run: list[RoundView]) -> str:
    """Consecutive AR rounds of a speculative run, as one row."""
    a, b = run[0].index, run[-1].index
    where = f"round {a}" if a == b else f"rounds {a}–{b}"
    n = sum(len(v.pieces) for v in run)
    return f"{where}: block 1, plain AR (the policy found drafting not worth it) → {tokens_text(n)}"


def widths_html(t: Transcript) -> str:
    """How often each block (drafted ids + 1) was verified: one line over the rounds of a speculative run."""
    counts: dict[int, int] = {}
    for v in t.rounds:
        if not v.prefill:
            counts[len(v.drafted) + 1] = counts.get(len(v.drafted) + 1, 0) + 1
    if not counts:
        return ""
    parts = [f"{b}{' (AR)' if b == 1 else ''} × {n}" for b, n in sorted(counts.items())]
    return f'<div class="blk-widths">block per round: {esc(", ".join(parts))}</div>'


def rounds_table_html(t: Transcript, limit: int = 400) -> str:
    """Every round's verify width and drafted block, for the 'every round' accordion (AR runs as one row)."""
    rows, run = [], []

    def close_run() -> None:
        if run:
            rows.append(f'<div class="blk-row ar"><span class="blk-cap">{esc(ar_run_caption(run))}</span></div>')
            run.clear()

    for v in t.rounds[-limit:]:
        if v.ar:
            run.append(v)
            continue
        close_run()
        if v.drafted:
            rows.append(f'<div class="blk-row"><span class="blk-cap">{esc(round_caption(v))}</span>'
                        f'<span class="blk">{block_html(v)}</span></div>')
    close_run()
    if not rows:
        return '<div class="placeholder">The drafted blocks appear here after a speculative run.</div>'
    return widths_html(t) + '<div class="blk-list">' + "".join(rows) + "</div>"


def rate_html(tokens: int, seconds: float, rounds: int | None = None, tau: float | None = None) -> str:
    rate = tokens / seconds if seconds > 0 else 0.0
    extra = f" · {rounds} rounds · τ {tau:.2f}" if rounds else ""
    return f"<b>{rate:.1f} tok/s</b> · {tokens} tokens in {seconds:.2f} s{extra}"


def legend_html() -> str:
    chips = "".join(f'<span class="tok {k}">{esc(v)}</span>' for k, v in KINDS.items())
    return (f'<div class="dfl-legend">{chips}<span class="tok"><s class="rej">rejected draft</s></span>'
            '<span class="hint">hover a coloured group to see the block the drafter proposed</span></div>')


def banner_html(state: str, spec: tuple[int, float] | None = None, ar: tuple[int, float] | None = None,
                identical: bool | None = None, greedy: bool = True, mode: str = "", widths: str = "",
                speed: Speedup | None = None, paired: bool = False, policy: str = "") -> str:
    """The speedup banner. state: idle | spec | ar | both (lockstep) | done | stopped | failed; `widths` says what
    the policy chose, `speed` the measured ratio with its spread (none when too few rounds drafted), `paired`
    whether the two runs alternated round by round, `policy` what the policy learnt."""
    def rate(x):
        return x[0] / x[1] if x and x[1] > 0 else 0.0

    if state == "idle":
        msg = ("Send a message. The same prompt is decoded twice on the same target model: with DFlash speculative "
               "decoding and plain autoregressive. The speedup below is measured, not estimated.")
        return f'<div class="dfl-banner idle">{msg}</div>'
    if state == "spec":
        return f'<div class="dfl-banner run">⚡ Speculative decoding… {rate(spec):.1f} tok/s so far</div>'
    if state == "ar":
        return (f'<div class="dfl-banner run">Speculative done ({rate(spec):.1f} tok/s). '
                f'Now plain autoregressive on the same target… {rate(ar):.1f} tok/s so far</div>')
    if state == "both":
        return (f'<div class="dfl-banner run">⚡ Both in lockstep, taking turns (so the machine\'s load falls on both '
                f'alike)… speculative {rate(spec):.1f} tok/s, plain AR {rate(ar):.1f} tok/s so far</div>')
    if state == "failed":
        return '<div class="dfl-banner warn">The run did not finish: see the message under the chat.</div>'
    if state == "stopped":
        return '<div class="dfl-banner warn">■ Stopped. No speedup is reported for an interrupted run.</div>'
    s, a = rate(spec), rate(ar)
    if greedy:
        same = ("outputs identical ✓ (greedy: speculative decoding is lossless)" if identical
                else "outputs differ ✗ (unexpected under greedy)")
    else:
        same = "sampling: the two texts differ by chance; both follow the target's distribution"
    speed = speed or Speedup(s / a if a > 0 and s > 0 else None, None if a > 0 and s > 0 else "nothing was decoded")
    head, kind, note = verdict(speed, paired)
    lines = "".join(f"<br>{esc(x)}" for x in (note, widths, policy) if x)
    return (f'<div class="dfl-banner done {kind}"><span class="dfl-x">{head}</span>'
            f'<span class="dfl-detail">DFlash speculative <b>{s:.1f} tok/s</b> ({spec[0]} tokens, {spec[1]:.2f} s) vs '
            f'plain AR <b>{a:.1f} tok/s</b> ({ar[0]} tokens, {ar[1]:.2f} s) · {esc(same)}{esc(mode)}{lines}</span></div>')


def verdict(speed: Speedup, paired: bool = False) -> tuple[str, str, str]:
    """(headline, banner class, sentence) of a finished turn: no ratio when (almost) nothing was drafted, "about
    the same" when the spread of the ratio reaches both sides of 1, faster or slower only when all of it lies on
    one side."""
    if speed.value is None:
        return ("No speedup to report", "plain", f"No ratio: {speed.reason}.")
    x, spread = speed.value, speed.spread_text()
    runs = "One lockstep run of each (the two taking turns)" if paired else "One run of each"
    if speed.noisy:
        return (f"≈ AR speed ({x:.2f}×)", "even",
                f"{runs}; the ratio's spread ({spread}) reaches both sides of 1×: no faster or slower here.")
    if x >= 1:
        return (f"{x:.2f}× faster", "", f"{runs}; the ratio's spread: {spread}.")
    return (f"{x:.2f}× (slower here)", "slow",
            f"{runs}; the ratio's spread: {spread}. On this model and hardware drafting costs more than it saves.")


def tau_html(s: Summary | None, block: int, ar_rounds: int = 0) -> str:
    """τ over the speculative rounds; `ar_rounds`: rounds the policy decoded as plain AR (not in τ), with the
    policy's verdict when they are (almost) all of them."""
    verdict = ar_verdict(ar_rounds, s.rounds if s else 0)
    ar = (f" · {ar_rounds} plain AR round{'s' if ar_rounds != 1 else ''} (block 1)" if ar_rounds else "") + (f". {verdict}" if verdict else "")
    if s is None or not s.rounds:
        return ('<div class="dfl-tau"><div class="dfl-tau-v">τ –</div><div class="dfl-tau-l">mean tokens per target '
                f'forward (acceptance length){esc(ar)}</div></div>')
    return (f'<div class="dfl-tau"><div class="dfl-tau-v">τ {s.tau:.2f}</div><div class="dfl-tau-l">mean tokens per '
            f'target forward, out of {block} possible (block {block}: {block - 1} drafted + 1) · {s.rounds} speculative '
            f'round{"s" if s.rounds != 1 else ""}{esc(ar)}</div></div>')


def acceptance_frame(s: Summary | None, width: int):
    """P(drafted position i accepted), i = 1..width, as a DataFrame for gr.BarPlot."""
    import pandas as pd

    vals = list(s.accept_per_position) if s else []
    vals = (vals + [0.0] * width)[:width]
    return pd.DataFrame({"position": [str(i + 1) for i in range(width)], "acceptance": vals})


def histogram_frame(s: Summary | None, block: int):
    """Rounds by tokens emitted per round (accepted + 1 = 1..B), as a DataFrame for gr.BarPlot."""
    import pandas as pd

    hist = s.tau_histogram if s else {}
    return pd.DataFrame({"tokens": [str(k) for k in range(1, block + 1)], "rounds": [hist.get(k, 0) for k in range(1, block + 1)]})


def message_html(kind: str, text: str) -> str:
    """A visible message banner: kind is error, warn or info."""
    icon = {"error": "⚠", "warn": "⚠", "info": "ℹ"}.get(kind, "")    # glyphs every font has (no emoji font needed)
    return f'<div class="dfl-msg {kind}">{icon} {esc(text)}</div>' if text else ""
