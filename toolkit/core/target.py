"""What the toolkit needs to know about a target model, read once from its folder's JSON files.

One place for the lookups every part repeats: the text config of a multimodal layout (`text_config`), the EOS
ids (generation_config.json, then config.json, then the tokenizer), the context length, layer count, vocab
size, architecture and whether the folder holds an EXL3 model. No torch or transformers import: the GPU-free
parts (quantize planning, the Hub card, the exllamav3 backend before loading) read it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .folders import read_config

DEFAULT_CONTEXT = 1 << 20       # a config with no max_position_embeddings: no limit worth checking


def text_config(cfg: dict) -> dict:
    """The language model's config: `text_config` of a multimodal layout (Qwen3.5/3.6), else the config itself."""
    return cfg.get("text_config") or cfg


def as_ids(eos) -> tuple[int, ...]:
    """An eos_token_id value (an int, a list of ints or None) as a tuple of ids."""
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)


@dataclass(frozen=True)
class TargetInfo:
    """A target's config.json, generation config and tokenizer EOS, with the derived facts as properties."""

    config: dict
    generation: dict = field(default_factory=dict)   # generation_config.json (or GenerationConfig.to_dict())
    tokenizer_eos: int | list[int] | None = None      # the tokenizer's own EOS id, the last resort
    folder: Path | None = None

    @classmethod
    def read(cls, folder: str | Path, what: str | None = None) -> "TargetInfo":
        """Read a model folder; no config.json is one ToolkitError line (`what` names the flag, as in read_config)."""
        folder = Path(folder)
        return cls(read_config(folder, what), read_optional(folder / "generation_config.json"), tokenizer_eos(folder), folder)

    @classmethod
    def of_model(cls, model, tokenizer=None) -> "TargetInfo":
        """The same facts from a loaded transformers model (its config and generation_config) and tokenizer."""
        gen = getattr(model, "generation_config", None)
        return cls(model.config.to_dict(), gen.to_dict() if gen is not None else {},
                   getattr(tokenizer, "eos_token_id", None))

    @property
    def text(self) -> dict:
        return text_config(self.config)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """generation_config's eos_token_id, else config's (top level, then the text config), else the tokenizer's."""
        for eos in (self.generation.get("eos_token_id"), self.config.get("eos_token_id"), self.text.get("eos_token_id"),
                    self.tokenizer_eos):
            if eos is not None and as_ids(eos):
                return as_ids(eos)
        return ()

    @property
    def max_context(self) -> int:
        return int(self.text.get("max_position_embeddings") or DEFAULT_CONTEXT)

    @property
    def num_layers(self) -> int:
        return int(self.text.get("num_hidden_layers") or 0)

    @property
    def vocab_size(self) -> int:
        return int(self.text.get("vocab_size") or self.config.get("vocab_size") or 0)

    @property
    def architecture(self) -> str | None:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else None

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def exl3(self) -> bool:
        """An exllamav3 checkpoint: its quantization_config names the exl3 method."""
        return (self.config.get("quantization_config") or {}).get("quant_method") == "exl3"


def read_optional(path: Path) -> dict:
    """A JSON object file, or {} when it is missing or not valid JSON (optional files never stop a load)."""
    try:
        d = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return d if isinstance(d, dict) else {}


def tokenizer_eos(folder: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token, found in its added tokens or tokenizer.json's; None if absent."""
    tc = read_optional(folder / "tokenizer_config.json")
    eos = tc.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    for i, t in (tc.get("added_tokens_decoder") or {}).items():
        if isinstance(t, dict) and t.get("content") == eos:
            return int(i)
    tj = read_optional(folder / "tokenizer.json")
    for t in tj.get("added_tokens") or []:
        if t.get("content") == eos:
            return int(t["id"])
    vocab = (tj.get("model") or {}).get("vocab")
    return vocab.get(eos) if isinstance(vocab, dict) else None
