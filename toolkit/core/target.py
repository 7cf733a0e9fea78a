"""What the toolkit needs to know about a target model, read once from its folder's JSON files.

One place for the lookups every part repeats: the text config of a multimodal layout (`text_config`), the EOS
ids (generation_config.json, then config.json, then the tokenizer), the context length, layer count, vocab
size, architecture and whether the folder holds an EXL3 model. No torch or transformers import: the GPU-free
parts (quantize planning, the Hub card, the exllamav3 backend before loading) read it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import files
from .errors import ToolkitError
from .files import Num, number, shown
from .folders import read_config

DEFAULT_CONTEXT = 1 << 20       # a config with no max_position_embeddings: no limit worth checking
# The sizes of a model's config (top level and text_config): absent or null is unknown, any value present is a
# whole number of at least 1 (0 would mean "impossible", never "no limit").
SIZES = {
    "max_position_embeddings": Num(1, 2**40, "tokens", whole=True, null=True),
    "vocab_size": Num(1, 2**31 - 1, "tokens", whole=True, null=True),
    "num_hidden_layers": Num(1, 65536, "layers", whole=True, null=True),
    "num_attention_heads": Num(1, 65536, "heads", whole=True, null=True),
    "num_key_value_heads": Num(1, 65536, "heads", whole=True, null=True),
    "hidden_size": Num(1, 1 << 24, whole=True, null=True),
    "intermediate_size": Num(1, 1 << 28, whole=True, null=True),
    "head_dim": Num(1, 65536, whole=True, null=True),
}


def text_config(cfg: dict) -> dict:
    """The language model's config: `text_config` of a multimodal layout (Qwen3.5/3.6), else the config itself."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) and text else cfg


TOKEN_ID = Num(0, 2**31 - 1, "(a token id)", whole=True)


def as_ids(eos, where: str = "config.json", key: str = "eos_token_id") -> tuple[int, ...]:
    """An eos_token_id value (an int, a list of ints or None) as a tuple of ids; anything else is one line."""
    if eos is None:
        return ()
    items = eos if isinstance(eos, list) else [eos]
    return tuple(number(e, TOKEN_ID, where, key) for e in items if e is not None)


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
        info = cls(read_config(folder, what), read_optional(folder / "generation_config.json"), tokenizer_eos(folder),
                   folder)
        info.check_sizes()
        return info

    @classmethod
    def of_model(cls, model, tokenizer=None) -> "TargetInfo":
        """The same facts from a loaded transformers model (its config and generation_config) and tokenizer."""
        gen = getattr(model, "generation_config", None)
        return cls(model.config.to_dict(), gen.to_dict() if gen is not None else {},
                   getattr(tokenizer, "eos_token_id", None))

    @property
    def text(self) -> dict:
        return text_config(self.config)

    def where(self, name: str = "config.json") -> str:
        return str(self.folder / name) if self.folder is not None else name

    def number(self, d: dict, key: str, num: Num, default: int) -> int:
        """d[key] in num's range (a missing or null value: `default`); else one line naming config.json and the key."""
        return default if d.get(key) is None else number(d[key], num, self.where(), key)

    def check_sizes(self) -> None:
        """Every size of SIZES present in the config (and its text_config) is a whole number >= 1: one line naming
        config.json and the key otherwise."""
        for d in (self.config, self.text) if self.text is not self.config else (self.config,):
            prefix = "text_config." if d is not self.config else ""
            for key, num in SIZES.items():
                if key in d:
                    number(d[key], num, self.where(), prefix + key)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """generation_config's eos_token_id, else config's (top level, then the text config), else the tokenizer's."""
        for eos, name in ((self.generation.get("eos_token_id"), "generation_config.json"),
                          (self.config.get("eos_token_id"), "config.json"), (self.text.get("eos_token_id"), "config.json"),
                          (self.tokenizer_eos, "tokenizer_config.json")):
            if eos is not None and as_ids(eos, self.where(name)):
                return as_ids(eos, self.where(name))
        return ()

    @property
    def max_context(self) -> int:
        return self.number(self.text, "max_position_embeddings", SIZES["max_position_embeddings"], DEFAULT_CONTEXT)

    @property
    def num_layers(self) -> int:
        """The layer count; 0 when the config does not say."""
        return self.number(self.text, "num_hidden_layers", SIZES["num_hidden_layers"], 0)

    @property
    def hidden_size(self) -> int:
        return self.number(self.text, "hidden_size", SIZES["hidden_size"], 0)

    @property
    def vocab_size(self) -> int:
        d = self.text if self.text.get("vocab_size") is not None else self.config
        return self.number(d, "vocab_size", SIZES["vocab_size"], 0)

    @property
    def architectures(self) -> list[str]:
        """config.json's architectures: a list of names ([] when absent); anything else is one line."""
        archs = self.config.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ToolkitError(f"{self.where()}: architectures must be a list of names, got {shown(archs)}")
        return archs

    @property
    def architecture(self) -> str | None:
        return self.architectures[0] if self.architectures else None

    @property
    def model_type(self) -> str | None:
        t = self.config.get("model_type")
        return t if isinstance(t, str) else None

    @property
    def exl3(self) -> bool:
        """An exllamav3 checkpoint: its quantization_config names the exl3 method."""
        q = self.config.get("quantization_config")
        return isinstance(q, dict) and q.get("quant_method") == "exl3"


def read_optional(path: Path) -> dict:
    """A JSON object file, or {} when it is missing or not a valid JSON object (optional files never stop a load)."""
    try:
        d = files.read_json(path) if path.is_file() else {}
    except (ToolkitError, OSError):
        return {}
    return d if isinstance(d, dict) else {}


def tokenizer_eos(folder: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token, found in its added tokens or tokenizer.json's; None if absent
    (or when what these optional files say is not a token id)."""
    tc = read_optional(folder / "tokenizer_config.json")
    eos = tc.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    added = tc.get("added_tokens_decoder")
    for i, t in (added.items() if isinstance(added, dict) else ()):
        if isinstance(t, dict) and t.get("content") == eos:
            return int(i) if i.isdigit() and len(i) <= 10 and TOKEN_ID.ok(int(i)) else None
    tj = read_optional(folder / "tokenizer.json")
    tokens = tj.get("added_tokens")
    for t in tokens if isinstance(tokens, list) else ():
        if isinstance(t, dict) and t.get("content") == eos:
            return t.get("id") if TOKEN_ID.ok(t.get("id")) else None
    model = tj.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    found = vocab.get(eos) if isinstance(vocab, dict) else None
    return found if TOKEN_ID.ok(found) else None
