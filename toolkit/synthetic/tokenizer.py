"""A stand-in tokenizer of exactly `vocab_size` entries: byte-level BPE (no merges) plus Qwen-style specials.

Not the real Qwen tokenizer (that cannot reach these machines): ids 0..255 are the 256 byte symbols,
filler pieces take the regular ids up to the first special, and the specials sit where Qwen3.5/3.6 puts
them for a 248,320 vocabulary (<|endoftext|> 248044, <|im_start|> 248045, <|im_end|> 248046, the rest
named <|special_ID|>, so the DFlash mask id 248077 exists). Text encodes byte by byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ToolkitError

QWEN_SPECIALS = 276                 # ids 248044..248319 of the Qwen3.5/3.6 vocabulary
MIN_VOCAB = 300
NAMED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Specials:
    """Where the special tokens sit for a vocabulary size."""

    first: int          # first special id; everything below is a regular byte-level piece
    endoftext: int
    im_start: int
    im_end: int


def specials_for(vocab_size: int) -> Specials:
    if vocab_size < MIN_VOCAB:
        raise ToolkitError(f"vocab_size must be >= {MIN_VOCAB} for the stand-in tokenizer, got {vocab_size}")
    n = min(QWEN_SPECIALS, (vocab_size - 256) // 2)
    first = vocab_size - n
    return Specials(first, first, first + 1, first + 2)


def _filler(i: int, alphabet: list[str]) -> str:
    """A distinct piece of three or more alphabet characters for filler id i (never a single byte)."""
    a = len(alphabet)
    chars = []
    while True:
        chars.append(alphabet[i % a])
        i //= a
        if i == 0 and len(chars) >= 3:
            break
    return "".join(chars)


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` with exactly vocab_size ids (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    sp = specials_for(vocab_size)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i in range(len(alphabet), sp.first):
        vocab[_filler(i, alphabet)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    names = [NAMED[i - sp.first] if i - sp.first < len(NAMED) else f"<|special_{i}|>" for i in range(sp.first, vocab_size)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"stand-in tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def write_tokenizer(folder: Path, vocab_size: int) -> Specials:
    """tokenizer.json, tokenizer_config.json and generation_config.json into `folder`; returns the special ids."""
    sp = specials_for(vocab_size)
    build_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144, "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"eos_token_id": [sp.im_end, sp.endoftext], "pad_token_id": sp.endoftext, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return sp
