"""The backend interface: what the app, the CLI and the benchmark call, whatever engine runs the models."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Generator, Iterator

from ..core.cli import check_options, option
from ..core.errors import OptionError, ToolkitError
from .events import Round
from .policy_book import PolicyBook


NUMBERS = ("max_new_tokens", "temperature", "seed")       # GenSettings' numbers, each with its domain


@dataclass
class GenSettings:
    """How to decode one prompt.

    block_size: "auto" (the default) lets the drafting policy (policy/chooser.py) pick each round's verify width
    w in 0..B-1 from measured round costs and running acceptance, B being the drafter's native block and w = 0 a
    plain AR round; the drafter proposes B-1 ids whenever w > 0, so a Round's `proposed` is B-1 and `drafted` its
    first w. An int N >= 2 is a fixed block: every round verifies min(N, B) - 1 drafts (the classic decoder).
    None is the drafter's native block, fixed. A backend without a policy treats "auto" as the native block.
    """

    # each number's domain beside its default: the commands' options (like()) and the chat app check against these
    max_new_tokens: int = option(64, lo=1)
    temperature: float = option(0.0, "0 = greedy", lo=0, hi=100)
    seed: int = option(0, kind="seed")
    block_size: int | str | None = "auto"    # "auto" | N >= 2 (fixed B = N, drafts cut to N-1) | None (native, fixed)
    stop_ids: tuple[int, ...] | None = None  # None = the target's EOS ids

    def __post_init__(self) -> None:
        try:
            check_options(GenSettings, {k: getattr(self, k) for k in NUMBERS})
        except OptionError as e:
            raise ValueError(str(e)) from None
        self.block_size = self.parse_block(self.block_size)

    @property
    def auto(self) -> bool:
        """Whether the drafting policy picks the width per round."""
        return self.block_size == "auto"

    def fixed_block(self, native: int) -> int:
        """The block of a fixed-width run, cut to the drafter's `native` block; `native` itself for "auto"/None."""
        return native if self.auto or self.block_size is None else min(self.block_size, native)

    @staticmethod
    def parse_block(value) -> int | str | None:
        """ "auto", None or an int >= 2 (also from a string such as "8", for CLIs and web forms)."""
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None if value is None else "auto"
        try:
            n = int(value)
        except (TypeError, ValueError, OverflowError):      # a word, nan, inf
            n = None
        if n is None or (not isinstance(value, str) and n != value) or isinstance(value, bool):
            raise ValueError(f"block_size must be auto or an integer >= 2, got {value!r}")
        if n < 2:
            raise ValueError(f"block_size must be >= 2, got {n}")
        return n

    @staticmethod
    def parse_blocks(values, field: str = "block_sizes") -> list[int | str]:
        """A non-empty list of block sizes, each "auto" or an int >= 2 (also as strings), for bench and eval_tau."""
        try:
            blocks = [GenSettings.parse_block(b) for b in values or ()]
        except ValueError:
            blocks = []
        if not blocks or None in blocks:
            raise OptionError(field, f"must be integers >= 2 or auto, got {list(values or ())}")
        return blocks


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


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, read by consumers instead of its name."""

    batching: bool = False           # generate_many decodes several jobs together in one engine
    gpu_only: bool = False           # runs on a CUDA GPU only (no --device)
    precision: str = "float32"       # the dtype it computes in by default
    levers: type | None = None       # its options dataclass (Exl3Options) when it has levers
    placement: bool = False          # takes a GPU split (--gpu-split, --tensor-parallel, --draft-device)
    cache_tokens: bool = False       # sizes a paged cache (--cache-tokens)
    width_multiple: int = 1          # model widths it needs a multiple of (a smaller model is padded to them)
    engine: str = "PyTorch"          # the engine in words, for pages
    unquantized: bool = False        # loads unquantized folders only: an EXL3 one is refused by its kind before loading


class Backend(ABC):
    """A target plus an optional DFlash drafter that turns prompts into a stream of `Round`s.

    Every consumer (generate, bench, eval_tau, the app) calls these members as written; a backend sets the
    attributes in its constructor and implements `generate`. The token methods work on a transformers
    tokenizer; a backend whose tokenizer is something else overrides them. A backend with a drafting policy keeps
    it, with its round costs, in `book` (runtime/policy_book.py), which consumers read.
    """

    name: str
    caps: Capabilities = Capabilities()
    book: PolicyBook | None = None  # the auto policies and their round costs (None: a backend without a policy)

    @classmethod
    def installed(cls) -> bool:
        """Whether what this backend needs is installed here (a GPU is checked when it loads)."""
        return True
    block_size: int                 # the drafter's native block size (1 without a drafter)
    max_context: int                # longest prompt + generation the target takes
    eos_ids: tuple[int, ...]        # stop ids when GenSettings.stop_ids is None
    tokenizer: Any                  # the target's transformers tokenizer

    @property
    def supports_thinking(self) -> bool:
        """Whether the chat template has an `enable_thinking` switch (Qwen3 / Qwen3.5 / Qwen3.6)."""
        return "enable_thinking" in str(getattr(self.tokenizer, "chat_template", None) or "")

    # -- tokens --------------------------------------------------------------------------------------

    def encode(self, prompt, system: str | None = None, thinking: bool | None = None) -> list[int]:
        """Token ids of a chat prompt or conversation (through the chat template when the tokenizer has one)."""
        return encode_chat(self.tokenizer, prompt, system, thinking)

    def raw_encode(self, text: str) -> list[int]:
        """Token ids of `text` as is, without the chat template (--raw)."""
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- decoding ------------------------------------------------------------------------------------

    @abstractmethod
    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Generator[Round, None, None]:
        """Decode one prompt; with speculative=False the same target runs plain AR (one token per round)."""

    def generate_many(self, prompts: list[list[int]], settings: GenSettings,
                      speculative: bool = True) -> Iterator[tuple[int, Round]]:
        """Decode several prompts, yielding (prompt index, Round); here one after another, batched where a backend can.
        Every prompt is checked before the first is decoded."""
        self.check_prompts(prompts, settings.max_new_tokens)
        for i, p in enumerate(prompts):
            for r in self.generate(p, settings, speculative):
                yield i, r

    def prepare(self, settings: GenSettings, concurrency: int = 1) -> None:
        """Do the one-time work `settings` needs (the auto policy's cost calibration) now, so a timed run that
        follows measures decoding only; nothing to do by default."""

    def warm_up(self, prompt_ids: list[int], settings: GenSettings | None = None,
                modes: tuple[bool, ...] = (True, False)) -> None:
        """prepare(), then a 4-token decode in each mode (speculative, AR): lazy initialisation and the first slow
        forwards happen here, not in the first measured run. The auto policies are left as they were: one proposal
        of a 4-token decode says little of the drafter, and could send the next request to plain AR."""
        settings = settings or GenSettings()
        self.prepare(settings)
        saved = self.book.save() if self.book is not None else None
        short = replace(settings, max_new_tokens=min(4, settings.max_new_tokens))
        for speculative in modes:
            for _ in self.generate(prompt_ids, short, speculative=speculative):
                pass
        if saved is not None:
            self.book.restore(saved)

    def close(self) -> None:
        """Free what the backend holds (GPU memory); nothing to do by default."""

    # -- what the benchmark asks ---------------------------------------------------------------------

    def set_options(self, options) -> None:
        """Use these engine options (levers) from the next generate on; None: the backend's defaults. A backend
        without options ignores them."""

    def auto_policy(self, settings: GenSettings):
        """The auto policy `settings` decode with (None before its first auto run, or without one)."""
        return self.book.live(settings.temperature <= 0) if self.book is not None else None

    def cost_source(self) -> str | None:
        """Where the auto policy's cost table came from ("timed now", "cached PATH", "given"), once it has one."""
        return self.book.source_text() if self.book is not None else None

    def calibration_report(self) -> dict | None:
        """What the current options' cost timing saw in this process (tokens a job emitted per round), if any."""
        return None

    def engine_report(self) -> dict | None:
        """Engine facts a benchmark cell records (which kernel path ran), if the backend has any."""
        return None

    # -- shared checks -------------------------------------------------------------------------------

    def draft_width(self, settings: GenSettings, speculative: bool) -> int:
        """Tokens drafted per round: B-1 for the asked block size B, cut to the drafter's; 0 for plain AR."""
        if not speculative or self.block_size < 2:
            return 0
        return settings.fixed_block(self.block_size) - 1

    def stop_ids(self, settings: GenSettings) -> tuple[int, ...]:
        return tuple(settings.stop_ids if settings.stop_ids is not None else self.eos_ids)

    def check_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """One line for an empty prompt or one that does not fit the context with its new tokens."""
        if not prompts or any(not p for p in prompts):
            raise ToolkitError("prompt is empty")
        n = max(len(p) for p in prompts)
        if n + max_new_tokens > self.max_context:
            raise ToolkitError(f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds the context of {self.max_context}")
