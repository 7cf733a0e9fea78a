"""What a chat turn may hold: every value the page or an API client sends to /chat, checked as the command line
checks its options, before anything is encoded or decoded.

The numbers take their domains from GenSettings (runtime/backend.py), the ones `generate`, `bench` and
`eval_tau` declare too; texts must be UTF-8 (no lone surrogate, no NUL) and at most MAX_TEXT characters; the
history may be either shape docs/app.md shows. A value outside is `Refused`: one sentence naming the field, which
the page shows under the chat and an API client reads as the result's `error`. A conversation longer than the
model's context loses its oldest messages until it fits, and the turn says how many (`Turn.dropped`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..core.cli import check_number, domain_of, valid_text
from ..core.errors import OptionError, ToolkitError
from ..runtime.backend import NUMBERS, Backend, GenSettings

FAILED = "⚠️ "          # the start of the chat reply of a turn that failed
MAX_TEXT = 1 << 20      # characters in the message, the system prompt or one earlier message
MAX_HISTORY = 4096      # earlier messages read; older ones are left out, as those over the context are
LABELS = {"message": "The message", "history": "The history", "block_size": "Block size",
          "max_new_tokens": "Max new tokens", "temperature": "Temperature", "seed": "Seed",
          "system": "The system prompt", "thinking": "Thinking mode"}
SHAPES = ('each earlier turn is a message {"role": "user" or "assistant", "content": text} or a [user, assistant] '
          "pair of texts")


class Refused(ToolkitError):
    """One sentence saying which value of the turn is wrong and what it may be."""


@dataclass
class Turn:
    """A checked turn: the new message, the chat as the page shows it, the earlier messages the prompt sees."""

    text: str
    shown: list[dict]           # every earlier message, as text (a failed turn included)
    context: list[dict]         # what the prompt sees: no failed turn, no empty message, roles alternating
    settings: GenSettings
    choice: int | str           # the block: "auto" or a fixed size cut to the drafter's
    system: str | None
    thinking: bool | None
    dropped: int = 0            # earlier messages left out (beyond MAX_HISTORY, then to fit the context)


def kind(value) -> str:
    names = {bool: "true/false", int: "a number", float: "a number", str: "text", list: "a list", tuple: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def text(field: str, value, what: str | None = None) -> str:
    """A text value (None: empty), valid UTF-8 and at most MAX_TEXT characters."""
    what = what or LABELS[field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise Refused(f"{what} must be text, got {kind(value)}.")
    if len(value) > MAX_TEXT:
        raise Refused(f"{what} is {len(value):,} characters; at most {MAX_TEXT:,} are read.")
    if not valid_text(value):
        if "\x00" in value:
            raise Refused(f"{what} holds a NUL character ('\\x00'), which the app does not take.")
        bad = next(c for c in value if 0xD800 <= ord(c) <= 0xDFFF)
        raise Refused(f"{what} is not UTF-8 text: it holds a lone surrogate ({ascii(bad)}).")
    return value


def content(value, what: str) -> str:
    """A message's content as text: a string, or gradio's text parts (file and component parts carry no text)."""
    if value is None or isinstance(value, str):
        return text("history", value, what)
    if isinstance(value, dict):
        if value.get("type", "text") != "text":
            return ""
        return text("history", value.get("text"), what)
    if isinstance(value, (list, tuple)):
        return "\n".join(t for t in (content(v, what) for v in value) if t)
    raise Refused(f"{what} must be text or a list of text parts, got {kind(value)}.")


def read_history(history) -> tuple[list[dict], int]:
    """The earlier messages as [{"role", "content": text}], oldest first, and how many were left out (beyond the
    last MAX_HISTORY). A system message is skipped: the system prompt has its own field."""
    if history is None:
        return [], 0
    if not isinstance(history, (list, tuple)):
        raise Refused(f"The history must be a list (a first turn sends []), got {kind(history)}.")
    skip = max(0, len(history) - MAX_HISTORY)
    out: list[dict] = []
    for i, item in enumerate(history[skip:], skip):
        if isinstance(item, dict):
            role = item.get("role")
            if role == "system":
                continue
            if role not in ("user", "assistant"):
                raise Refused(f"The history's message {i} has role {role!r}: {SHAPES}.")
            out.append({"role": role, "content": content(item.get("content"), f"The history's message {i}")})
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            for role, part in zip(("user", "assistant"), item):
                if part is not None:
                    out.append({"role": role, "content": content(part, f"The history's turn {i}")})
        else:
            raise Refused(f"The history's item {i} is {kind(item)}: {SHAPES}.")
    return out, skip


def prompt_messages(shown: list[dict]) -> list[dict]:
    """The messages the prompt sees: a failed turn (the app's warning and the message it answered) and empty
    messages dropped, consecutive messages of one role joined, a leading reply dropped (chat templates want turns
    that alternate and start with the user)."""
    out: list[dict] = []
    for m in shown:
        if m["role"] == "assistant" and m["content"].startswith(FAILED):
            if out and out[-1]["role"] == "user":
                out.pop()
            continue
        if not m["content"].strip():
            continue
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        elif out or m["role"] == "user":
            out.append(dict(m))
    return out


def number(field: str, value) -> int | float:
    """A number of GenSettings in its domain (None: its default); a whole float such as 8.0 counts as 8."""
    f = next(f for f in fields(GenSettings) if f.name == field)
    if value is None:
        return f.default
    integer = f.type in (int, "int")
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        check_number(field, value, domain_of(GenSettings, field), integer)
    except OptionError as e:
        raise Refused(f"{LABELS[field]}{e.rest}.") from None
    return value


def block(value, native: int) -> int | str:
    """ "auto" or a whole number >= 2, cut to the drafter's native block (None or empty: auto)."""
    if value is None or value == "":
        return "auto"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        choice = GenSettings.parse_block(value)
    except ValueError:
        choice = None
    if choice is None:
        raise Refused(f"Block size must be auto or a whole number from 2 to {native}, got {value!r}.")
    return choice if choice == "auto" else min(choice, native)


def read_turn(message, history, block_size, max_new_tokens, temperature, seed, system, thinking, *, native: int,
              can_think: bool) -> Turn:
    """Every field of a /chat request checked (Refused names the first wrong one)."""
    new = text("message", message).strip()
    shown, skipped = read_history(history)
    choice = block(block_size, native)
    nums = {k: number(k, v) for k, v in zip(NUMBERS, (max_new_tokens, temperature, seed))}
    sys_text = text("system", system).strip() or None
    if thinking is not None and not isinstance(thinking, bool):
        raise Refused(f"Thinking mode must be true or false, got {kind(thinking)}.")
    settings = GenSettings(**nums, block_size=choice)
    return Turn(new, shown, prompt_messages(shown), settings, choice, sys_text,
                bool(thinking) if can_think else None, skipped)


def fit(be: Backend, turn: Turn) -> list[int]:
    """The prompt's ids: the whole conversation through the chat template (a first turn as the plain message),
    its oldest messages left out while it and the new tokens exceed the model's context (counted in
    turn.dropped); a message too long on its own is one ToolkitError sentence."""
    n, limit = turn.settings.max_new_tokens, be.max_context

    def encode(earlier: list[dict]) -> list[int]:
        prompt = prompt_messages(earlier + [{"role": "user", "content": turn.text}]) if earlier else turn.text
        return be.encode(prompt, system=turn.system, thinking=turn.thinking)

    ids = encode(turn.context)
    if len(ids) + n <= limit:
        return ids
    alone = encode([])
    if len(alone) + n > limit:
        raise ToolkitError(f"The prompt is {len(alone)} tokens; with {n} new tokens that exceeds the model's context "
                           f"of {limit}. Shorten the prompt or lower max new tokens.")
    starts = [i for i, m in enumerate(turn.context) if m["role"] == "user" and i > 0] + [len(turn.context)]
    lo, hi, best = 0, len(starts) - 1, alone          # the fewest messages left out that fit: a binary search
    while lo < hi:
        mid = (lo + hi) // 2
        ids = encode(turn.context[starts[mid]:])
        if len(ids) + n <= limit:
            hi, best = mid, ids
        else:
            lo = mid + 1
    turn.dropped += starts[lo]
    return best


def dropped_note(turn: Turn, limit: int) -> str:
    """The sentence that says which earlier messages the prompt left out, or ""."""
    if not turn.dropped:
        return ""
    what = "earlier message was" if turn.dropped == 1 else f"{turn.dropped} earlier messages were"
    return (f"The oldest {what} left out: the conversation did not fit the model's context of {limit} tokens with "
            f"{turn.settings.max_new_tokens} new tokens.")
