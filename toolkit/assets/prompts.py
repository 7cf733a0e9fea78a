"""The benchmark's built-in prompt set (chat, code, math) and the reader for --prompts FILE."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core import files
from ..core.errors import ToolkitError


@dataclass(frozen=True)
class Prompt:
    """A user message and its category; `context` holds the conversation before it, ((role, text), ...) with role
    "user" or "assistant", oldest first (empty: the message alone)."""

    text: str
    category: str = "file"
    context: tuple = ()

    def messages(self) -> str | list[dict]:
        """What the chat template takes: the text alone, or the whole conversation ending with it."""
        if not self.context:
            return self.text
        return [{"role": r, "content": t} for r, t in self.context] + [{"role": "user", "content": self.text}]


CHAT = [
    "Explain in two paragraphs why the sky looks blue during the day and red at sunset.",
    "Write a short, friendly email asking a colleague to review a pull request by Friday.",
    "What are three good habits for keeping a small team's documentation up to date?",
    "Summarize the plot of a detective story in which the butler turns out to be innocent.",
    "Give me a packing list for a three-day hiking trip in autumn.",
    "Describe the difference between weather and climate to a ten-year-old.",
    "Suggest five names for a coffee shop that also sells used books, with one line on each.",
    "How should I prepare for a job interview for a junior data analyst position?",
]

CODE = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Implement binary search over a sorted list in Python and explain its complexity.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Show how to read a CSV file with the csv module and sum the values of one column.",
    "Write a function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Explain what this does and fix its bug: def mean(xs): return sum(xs) / len(xs) - 1",
    "Write a Python generator that yields the lines of a file that contain a given word.",
    "Implement a least-recently-used cache in Python using collections.OrderedDict.",
]

MATH = [
    "Solve for x: 3x + 7 = 22. Show each step.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Explain.",
    "What is the sum of the integers from 1 to 100? Show the reasoning.",
    "Factor the polynomial x^2 - 5x + 6 and give its roots.",
    "A rectangle has a perimeter of 30 cm and a length of 9 cm. Find its area step by step.",
    "Compute 15% of 240, then add 12 to the result. Show your work.",
    "If a fair die is rolled twice, what is the probability that the sum is 7?",
    "Convert the fraction 7/8 to a decimal and to a percentage, explaining each step.",
]

BUILTIN = [Prompt(t, "chat") for t in CHAT] + [Prompt(t, "code") for t in CODE] + [Prompt(t, "math") for t in MATH]


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The built-in set, or the prompts of a file: JSON lines ({"prompt": ..., "category": ...}) or one prompt a line."""
    if path is None:
        return list(BUILTIN)
    p = Path(path)
    if not p.is_file():
        raise ToolkitError(f"--prompts: {path} is not a file")
    out: list[Prompt] = []
    for n, line in enumerate(files.read_text(p, "--prompts").splitlines(), 1):   # UTF-8, size cap, .gz
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            d = files.parse_json(line, f"--prompts: {path} line {n}")             # depth cap
            text = d.get("prompt") or d.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ToolkitError(f"--prompts: {path} line {n} has no \"prompt\" string")
            out.append(Prompt(text, str(d.get("category", "file"))))
        else:
            out.append(Prompt(line))
    if not out:
        raise ToolkitError(f"--prompts: {path} has no prompts")
    return out


def mixed(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over their categories, so that a short run still mixes them."""
    cats = sorted({p.category for p in prompts}, key=[p.category for p in prompts].index)
    order = [p for k in range(len(prompts)) for c in cats for p in [q for q in prompts if q.category == c][k:k + 1]]
    return order[:limit]
