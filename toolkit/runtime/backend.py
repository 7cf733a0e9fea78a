"""The backend interface: what the app, the CLI and the benchmark call, whatever engine runs the models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, runtime_checkable

from .events import Round


@dataclass
class GenSettings:
    """How to decode one prompt."""

    max_new_tokens: int = 64
    temperature: float = 0.0        # 0 = greedy
    seed: int = 0
    block_size: int | None = None   # verify width B; None = the drafter's own; drafts are cut to B-1
    stop_ids: tuple[int, ...] | None = None  # None = the target's EOS ids

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")


def message_text(content) -> str:
    """A chat message's text: a string, or gradio 6's list of parts (text parts only; files and media dropped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "\n".join(t for t in map(message_text, content) if t)
    return ""


def encode_chat(tokenizer, prompt, system: str | None = None, thinking: bool | None = None) -> list[int]:
    """Ids of a chat through the tokenizer's chat template, or plain ids when it has none.

    `prompt` is one user message (a string) or the whole conversation: a list of {"role", "content"} dicts,
    oldest first, ending with the user's new message (content a string, or a list of parts whose text parts
    count). The system prompt, when given, goes first. Without a template the turns' texts are joined by newlines.
    """
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    else:
        msgs = [{"role": m["role"], "content": message_text(m.get("content"))} for m in prompt]
    if getattr(tokenizer, "chat_template", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + msgs
        kw = {} if thinking is None else {"enable_thinking": thinking}
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in msgs))


@runtime_checkable
class Backend(Protocol):
    """A target plus an optional DFlash drafter that turns prompts into a stream of `Round`s."""

    name: str
    block_size: int       # the drafter's native block size (1 without a drafter)
    max_context: int      # longest prompt + generation the target takes

    def encode(self, prompt: str, system: str | None = None, thinking: bool | None = None) -> list[int]:
        """Token ids of a chat prompt (through the chat template when the tokenizer has one)."""
        ...

    def decode(self, ids: list[int]) -> str:
        ...

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        """Decode; with speculative=False the same target runs plain AR (one token per round)."""
        ...
