"""The Backend base class (sequential generate_many, supports_thinking, shared checks) and TargetInfo's lookups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.core.errors import ToolkitError
from toolkit.core.target import TargetInfo, text_config
from toolkit.runtime.backend import Backend, GenSettings
from toolkit.runtime.events import Round, tokens_of


class Tok:
    def __init__(self, template=None):
        self.chat_template = template


class Counting(Backend):
    """Each prompt continues with prompt[-1]+1, +2, ...; drafts nothing in AR mode."""

    name, block_size, max_context, eos_ids = "counting", 4, 64, (99,)

    def __init__(self, template=None):
        self.tokenizer = Tok(template)
        self.calls: list[list[int]] = []

    def generate(self, prompt_ids, settings, speculative=True):
        self.check_prompts([prompt_ids], settings.max_new_tokens)
        self.calls.append(list(prompt_ids))
        width = self.draft_width(settings, speculative)
        t = prompt_ids[-1]
        yield Round((), 0, t + 1, prefill=True)
        for k in range(settings.max_new_tokens - 1):
            yield Round(tuple(range(width)), 0, t + 2 + k)


def test_generate_many_runs_the_prompts_in_order_with_their_index():
    be = Counting()
    out = list(be.generate_many([[1], [10, 20], [5]], GenSettings(max_new_tokens=3)))
    assert [i for i, _ in out] == [0] * 3 + [1] * 3 + [2] * 3
    assert [tokens_of([r for i, r in out if i == k]) for k in range(3)] == [[2, 3, 4], [21, 22, 23], [6, 7, 8]]
    assert be.calls == [[1], [10, 20], [5]]
    assert [len(r.drafted) for _, r in out[:3]] == [0, 3, 3]
    assert [len(r.drafted) for _, r in be.generate_many([[1]], GenSettings(max_new_tokens=2), speculative=False)] == [0, 0]


def test_generate_many_checks_each_prompt():
    be = Counting()
    with pytest.raises(ToolkitError, match="prompt is empty"):
        list(be.generate_many([[1], []], GenSettings(max_new_tokens=4)))
    assert be.calls == []                                   # checked before the first prompt is decoded
    with pytest.raises(ToolkitError, match="^prompt of 60 tokens \\+ 8 new tokens exceeds the context of 64$"):
        list(Counting().generate_many([[1], [1] * 60], GenSettings(max_new_tokens=8)))


def test_supports_thinking_follows_the_chat_template():
    assert not Counting().supports_thinking
    assert not Counting("{{ messages }}").supports_thinking
    assert Counting("{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}").supports_thinking
    be = Counting()
    be.tokenizer.chat_template = "{% if enable_thinking %}x{% endif %}"   # read each time, not cached
    assert be.supports_thinking


def test_draft_width_stop_ids_and_close():
    be = Counting()
    assert be.draft_width(GenSettings(), True) == 3 and be.draft_width(GenSettings(block_size=2), True) == 1
    assert be.draft_width(GenSettings(block_size=16), True) == 3 and be.draft_width(GenSettings(), False) == 0
    assert be.stop_ids(GenSettings()) == (99,) and be.stop_ids(GenSettings(stop_ids=(1, 2))) == (1, 2)
    assert be.close() is None


def test_torch_backend_is_a_backend_with_the_targets_facts(pair_backend, pair):
    info = TargetInfo.read(pair[0])
    assert isinstance(pair_backend, Backend)
    assert pair_backend.eos_ids == info.eos_ids == (2,) and pair_backend.max_context == info.max_context == 1024
    ids = pair_backend.raw_encode("Return the list")
    assert ids == list(pair_backend.tokenizer.encode("Return the list")) and pair_backend.encode("Return the list") != ids
    rounds = [r for _, r in pair_backend.generate_many([ids, ids[:2]], GenSettings(max_new_tokens=6))]
    assert len(tokens_of(rounds)) == 12


# -- TargetInfo -----------------------------------------------------------------------------------------


def write(folder: Path, name: str, obj) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(obj))


def test_eos_precedence_generation_then_config_then_tokenizer(tmp_path):
    write(tmp_path, "config.json", {"eos_token_id": 7, "max_position_embeddings": 512})
    write(tmp_path, "generation_config.json", {"eos_token_id": [3, 4]})
    write(tmp_path, "tokenizer_config.json", {"eos_token": "</s>", "added_tokens_decoder": {"9": {"content": "</s>"}}})
    assert TargetInfo.read(tmp_path).eos_ids == (3, 4)
    write(tmp_path, "generation_config.json", {"do_sample": False})
    assert TargetInfo.read(tmp_path).eos_ids == (7,)
    write(tmp_path, "config.json", {"text_config": {"eos_token_id": 8}})
    assert TargetInfo.read(tmp_path).eos_ids == (8,)
    write(tmp_path, "config.json", {})
    assert TargetInfo.read(tmp_path).eos_ids == (9,)
    write(tmp_path, "tokenizer_config.json", {"eos_token": {"content": "<|end|>"}})
    write(tmp_path, "tokenizer.json", {"added_tokens": [{"id": 11, "content": "<|end|>"}], "model": {"vocab": {}}})
    assert TargetInfo.read(tmp_path).eos_ids == (11,)
    write(tmp_path, "tokenizer.json", {"added_tokens": [], "model": {"vocab": {"<|end|>": 12}}})
    assert TargetInfo.read(tmp_path).eos_ids == (12,)
    (tmp_path / "tokenizer_config.json").unlink()
    assert TargetInfo.read(tmp_path).eos_ids == ()


def test_text_config_nesting_and_flat_configs():
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "vocab_size": 5,
              "text_config": {"num_hidden_layers": 40, "vocab_size": 248320, "max_position_embeddings": 262144}}
    info = TargetInfo(nested)
    assert text_config(nested) is nested["text_config"] and info.text is nested["text_config"]
    assert (info.num_layers, info.vocab_size, info.max_context) == (40, 248320, 262144)
    assert (info.architecture, info.model_type) == ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")
    flat = TargetInfo({"num_hidden_layers": 3, "vocab_size": 512})
    assert flat.text is flat.config and (flat.num_layers, flat.vocab_size) == (3, 512)
    assert flat.max_context == 1 << 20 and flat.architecture is None


def test_exl3_detection():
    assert TargetInfo({"quantization_config": {"quant_method": "exl3", "bits": 4.0}}).exl3
    assert not TargetInfo({"quantization_config": {"quant_method": "gptq"}}).exl3
    assert not TargetInfo({}).exl3


def test_read_errors_and_broken_optional_files(tmp_path):
    with pytest.raises(ToolkitError, match=r"^--target: .* has no config.json \(not a model folder\)$"):
        TargetInfo.read(tmp_path, "target")
    write(tmp_path, "config.json", {"eos_token_id": 1})
    (tmp_path / "generation_config.json").write_text("{not json")
    assert TargetInfo.read(tmp_path).eos_ids == (1,)


def test_of_model_matches_read(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = pair[0]
    model, tok = AutoModelForCausalLM.from_pretrained(str(target)), AutoTokenizer.from_pretrained(str(target))
    a, b = TargetInfo.of_model(model, tok), TargetInfo.read(target)
    assert (a.eos_ids, a.max_context, a.num_layers, a.vocab_size) == (b.eos_ids, b.max_context, b.num_layers, b.vocab_size)


def test_target_module_does_not_import_torch():
    code = "import sys, toolkit.core.target; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "False"


def test_a_load_reads_the_target_config_once(monkeypatch):
    """The pair is read and checked once per load and handed down (transformers reads its own copy)."""
    from toolkit.assets.pairs import tiny_pair
    from toolkit.core import target as target_mod
    from toolkit.runtime.factory import load_backend

    reads = []
    real = target_mod.TargetInfo.read.__func__
    monkeypatch.setattr(target_mod.TargetInfo, "read", classmethod(lambda cls, *a, **k: reads.append(a[0]) or real(cls, *a, **k)))
    t, d = tiny_pair()
    load_backend("torch", t, d).close()
    assert [str(p) for p in reads].count(str(t)) == 1
