"""DFlashConfig: the drafter's config.json, read in the upstream layouts, and its checks against a target."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import ToolkitError
from ..core.files import Num, number, shown
from ..core.folders import read_config
from ..core.target import TargetInfo

ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


def _pick(cfg: dict, key: str, default: Any = None) -> Any:
    """A DFlash key from `dflash_config` (current upstream layout) or the top level (older revisions)."""
    nested = cfg.get("dflash_config") or {}
    if key in nested:
        return nested[key]
    return cfg.get(key, default)


def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", None):
        raise ToolkitError(f"config.json: rope_type {shown(kind)} is not supported by the reference drafter (only 'default')")
    return float(number(cfg.get("rope_theta", rp.get("rope_theta", 10000.0)), Num(0, 1e12, above=True), "config.json",
                        "rope_theta"))


DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "tap_shift", "is_causal", "input_embedding_scale")
# The numbers of a drafter's config.json: key -> (type and range, default); None with no null: a required key.
WIDTH = Num(1, 1 << 20, whole=True)
LAYER = Num(0, 65535, "(a target layer)", whole=True)
NUMBERS = {
    "hidden_size": (WIDTH, None), "intermediate_size": (WIDTH, None),
    "num_hidden_layers": (Num(1, 4096, "layers", whole=True), None),
    "num_attention_heads": (Num(1, 4096, "heads", whole=True), None),
    "num_key_value_heads": (Num(1, 4096, "heads", whole=True, null=True), None),
    "head_dim": (Num(1, 65536, whole=True, null=True), None),
    "block_size": (Num(2, 4096, "tokens", whole=True), None),
    "mask_token_id": (Num(0, 2**31 - 1, "(a token id)", whole=True), None),
    "sliding_window": (Num(1, 2**31, "tokens", whole=True, null=True), None),
    "rms_norm_eps": (Num(0, 1, above=True), 1e-6),
    "tap_shift": (Num(-64, 64, "layers", whole=True), 1),
    "vocab_size": (Num(1, 2**31 - 1, "tokens", whole=True, null=True), None),
    "num_target_layers": (Num(1, 65536, "layers", whole=True, null=True), None),
    "max_position_embeddings": (Num(1, 2**40, "tokens", whole=True, null=True), None),
    "input_embedding_scale": (Num(-1e6, 1e6), 1.0),
}


@dataclass
class DFlashConfig:
    """The drafter's shape and its DFlash settings.

    `tap_shift` has exllamav3's meaning (same config key): tap L reads the output of target decoder layer
    L + tap_shift, i.e. HF hidden_states[L + tap_shift + 1]. exllamav3 defaults it to 1; z-lab's reference
    code reads the output of layer L itself, which is tap_shift 0. The quantize check measures both.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    layer_types: list[str]
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tap_shift: int = 1
    is_causal: bool | None = None   # None: sliding layers causal in the block, full layers bidirectional
    hidden_act: str = "silu"
    attention_bias: bool = False
    vocab_size: int | None = None
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    architecture: str = ARCHITECTURE
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> "DFlashConfig":
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or ARCHITECTURE not in archs:
            raise ToolkitError(f"config.json: architectures is {shown(archs)}, expected [{ARCHITECTURE!r}]")
        for key in ("dflash_config", "rope_parameters", "rope_scaling"):
            if cfg.get(key) is not None and not isinstance(cfg[key], dict):
                raise ToolkitError(f"config.json: {key} must be an object, got {shown(cfg[key])}")
        try:
            got = {k: _pick(cfg, k, d) if k in DFLASH_KEYS else cfg.get(k, d) for k, (_, d) in NUMBERS.items()}
            missing = [k for k, v in got.items() if v is None and not NUMBERS[k][0].null]
            if missing:
                raise KeyError(missing[0])
            for k, v in got.items():
                number(v, NUMBERS[k][0], "config.json", k)
            taps = _pick(cfg, "target_layer_ids")
            if taps is None:
                raise KeyError("target_layer_ids")
            if not isinstance(taps, list):
                raise ToolkitError(f"config.json: target_layer_ids must be a list of layers, got {shown(taps)}")
            for i, t in enumerate(taps):
                number(t, LAYER, "config.json", f"target_layer_ids[{i}]")
            hidden, heads, n_layers = got["hidden_size"], got["num_attention_heads"], got["num_hidden_layers"]
            layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
            for key, kind in (("layer_types", list), ("hidden_act", str), ("is_causal", bool), ("attention_bias", bool)):
                value = layer_types if key == "layer_types" else _pick(cfg, key) if key in DFLASH_KEYS else cfg.get(key)
                if value is not None and not isinstance(value, kind):
                    raise ToolkitError(f"config.json: {key} must be a {kind.__name__}, got {shown(value)}")
            conf = cls(
                hidden_size=hidden,
                intermediate_size=got["intermediate_size"],
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=got["num_key_value_heads"] or heads,
                head_dim=got["head_dim"] or max(1, hidden // heads),
                block_size=got["block_size"],
                mask_token_id=got["mask_token_id"],
                target_layer_ids=list(taps),
                layer_types=list(layer_types),
                sliding_window=got["sliding_window"],
                rms_norm_eps=float(got["rms_norm_eps"]),
                rope_theta=_rope_theta(cfg),
                tap_shift=got["tap_shift"],
                is_causal=_pick(cfg, "is_causal", None),
                hidden_act=cfg.get("hidden_act", "silu"),
                attention_bias=bool(cfg.get("attention_bias", False)),
                vocab_size=got["vocab_size"],
                num_target_layers=got["num_target_layers"],
                input_embedding_scale=float(got["input_embedding_scale"]),
                raw=cfg,
            )
        except KeyError as e:
            raise ToolkitError(f"config.json: missing key {e.args[0]!r}") from None
        conf.check()
        return conf

    @classmethod
    def from_dir(cls, path: str | Path) -> "DFlashConfig":
        cfg = read_config(path)
        if ARCHITECTURE not in TargetInfo(cfg, folder=Path(path)).architectures:   # name what the folder is instead
            from ..core.kinds import kind_of

            raise ToolkitError(f"{path} is {kind_of(TargetInfo(cfg))}, not a DFlash drafter (architectures "
                               f"{cfg.get('architectures')!r}, expected [{ARCHITECTURE!r}])")
        return cls.from_dict(cfg)

    def check(self) -> None:
        """Self-consistency: each failure is one line naming the field and the values."""
        if self.block_size < 2:
            raise ToolkitError(f"block_size must be >= 2, got {self.block_size}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ToolkitError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ToolkitError(f"layer_types: unknown type {bad[0]!r} (expected one of {', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ToolkitError("sliding_window must be set when layer_types has sliding_attention layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ToolkitError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ToolkitError(f"target_layer_ids must be non-empty and unique, got {self.target_layer_ids}")
        if self.hidden_act != "silu":
            raise ToolkitError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    def block_causal(self, layer: int) -> bool:
        """Whether block positions see only earlier block positions in this layer (exllamav3's rule)."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def validate_against(self, target: dict) -> None:
        """Check the drafter fits a target config.json (a dict; a multimodal config's text_config is used)."""
        info = TargetInfo(target)
        if ARCHITECTURE in info.architectures:
            raise ToolkitError("the target folder is a DFlash drafter, not a target model (a drafter goes to --draft)")
        th = info.number(info.text, "hidden_size", WIDTH, None)
        tl, tv = info.num_layers or None, info.vocab_size or None
        if th is not None and th != self.hidden_size:
            raise ToolkitError(f"hidden_size: drafter has {self.hidden_size}, target has {th}")
        if tl is not None:
            for tap in self.target_layer_ids:
                if not 0 <= tap < tl or not 0 <= tap + self.tap_shift < tl:
                    raise ToolkitError(
                        f"target_layer_ids: tap {tap} (tap_shift {self.tap_shift}) is outside the target's {tl} layers"
                    )
        if tv is not None and not 0 <= self.mask_token_id < tv:
            raise ToolkitError(f"mask_token_id: {self.mask_token_id} is outside the target's vocab_size {tv}")
        if tv is not None and self.vocab_size is not None and tv != self.vocab_size:
            raise ToolkitError(f"vocab_size: drafter has {self.vocab_size}, target has {tv}")
        if self.block_size < 2:
            raise ToolkitError(f"block_size must be >= 2, got {self.block_size}")

    def to_dict(self) -> dict:
        """config.json in the current upstream layout (DFlash keys under dflash_config), keeping unknown keys."""
        d = {k: v for k, v in self.raw.items() if k not in ("dflash_config",)}
        plain = asdict(self)
        plain.pop("raw")
        dflash = {k: plain.pop(k) for k in ("block_size", "mask_token_id", "target_layer_ids", "tap_shift")}
        if plain.get("is_causal") is not None:
            dflash["is_causal"] = plain["is_causal"]
        plain.pop("is_causal")
        if plain["input_embedding_scale"] != 1.0:
            dflash["input_embedding_scale"] = plain["input_embedding_scale"]
        plain.pop("input_embedding_scale")
        d.update({k: v for k, v in plain.items() if k != "architecture" and v is not None})
        d["architectures"] = [self.architecture]
        d.setdefault("model_type", "qwen3")
        d["block_size"] = dflash["block_size"]
        d["dflash_config"] = {**(self.raw.get("dflash_config") or {}), **dflash}
        return d
