"""Step 1: validate the drafter checkpoint (architecture, tensors from the safetensors headers) and its fit to the target."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..dflash import DFlashConfig, DFlashDraft
from ..dflash.config import ARCHITECTURE
from ..core.errors import ToolkitError
from ..core.folders import read_config
from ..core.target import TargetInfo
from ..core.tensorfiles import read_header, tensor_shapes  # noqa: F401  (read_header: re-exported)

OPTIONAL = ("mask_embedding",)


@dataclass
class Checked:
    """What validation learned: the config, the tensor headers (name -> (dtype, shape)) and the bytes on disk."""

    config: DFlashConfig
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    size_bytes: int = 0
    has_weights: bool = True


def read_headers(folder: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        total += f.stat().st_size
        for k, v in tensor_shapes(f).items():     # each header's structure and length checked (core.tensorfiles)
            out[k.removeprefix("model.")] = v
    return out, total


def expected_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the reference drafter needs, built on the meta device (no memory for the real shape)."""
    model = DFlashDraft.skeleton(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_architecture(cfg: dict, folder: Path) -> None:
    archs = TargetInfo(cfg, folder=Path(folder)).architectures      # a list of names, else one line
    if ARCHITECTURE in archs:
        return
    if cfg.get("auto_map"):
        raise ToolkitError(
            f"{folder}: architectures {archs} needs trust_remote_code and is not {ARCHITECTURE}; only DFlash drafters are converted"
        )
    raise ToolkitError(f"{folder}: architectures is {archs}, expected [{ARCHITECTURE!r}] (a DFlash drafter)")


def check_fit(config: DFlashConfig, target_cfg: dict, target: str | None = None) -> None:
    """The drafter against the target's config: hidden size, vocabulary, taps inside its layers, and its layer
    count against the drafter's num_target_layers. `target` names it in the message."""
    try:
        config.validate_against(target_cfg)
        layers = TargetInfo(target_cfg).num_layers
        if config.num_target_layers and layers and int(config.num_target_layers) != layers:
            raise ToolkitError(f"num_target_layers: drafter was made for {config.num_target_layers} target layers, "
                               f"target has {layers}")
    except ToolkitError as e:
        if target is None:
            raise
        kind = "EXL3 target" if TargetInfo(target_cfg).exl3 else "target"
        raise ToolkitError(f"--target: {kind} {target} does not fit the drafter: {e}") from None


def validate(folder: Path, target_cfg: dict | None = None, require_weights: bool = True,
             target: str | None = None) -> Checked:
    """Config, tensors and target fit. Without weights (a config-only folder) only a dry run may go on."""
    folder = Path(folder)
    raw = read_config(folder, "model")
    check_architecture(raw, folder)
    config = DFlashConfig.from_dict(raw)
    if target_cfg is not None:
        check_fit(config, target_cfg, target)
    headers, size = read_headers(folder)
    if not headers:
        if require_weights:
            raise ToolkitError(f"--model: {folder} has no *.safetensors weights")
        return Checked(config, {}, 0, has_weights=False)
    for name, shape in expected_shapes(config).items():
        if name not in headers:
            raise ToolkitError(f"{folder}: missing tensor {name!r}")
        if headers[name][1] != shape:
            raise ToolkitError(f"{folder}: tensor {name!r} has shape {list(headers[name][1])}, expected {list(shape)}")
    if "mask_embedding" in headers:
        n = 1
        for d in headers["mask_embedding"][1]:
            n *= d
        if n != config.hidden_size:
            raise ToolkitError(f"{folder}: tensor 'mask_embedding' has {n} values, expected {config.hidden_size}")
    return Checked(config, headers, size)


def check_shift_candidates(candidates: list[int], config: DFlashConfig, target_cfg: dict | None) -> None:
    """Before any work: the recipe's tap_shift candidates must hold one that puts every tap on a target layer
    (tap L + shift within the target's layers), or the check step would have none to try."""
    layers = TargetInfo(target_cfg or {}).num_layers or 1 << 30
    if not any(all(0 <= t + x < layers for t in config.target_layer_ids) for x in candidates):
        raise ToolkitError(f"recipe: each of check.tap_shift_candidates {candidates} puts a tap outside the target's "
                           f"{layers} layers (the drafter taps layers {list(config.target_layer_ids)})")


def check_finite_weights(folder: Path) -> None:
    """Refuse a drafter with a NaN or infinite weight before anything is converted or published (read tensor by
    tensor: the whole drafter is never in memory at once)."""
    from ..core.tensorfiles import iter_tensors
    from ..dflash.loading import check_finite

    for f in sorted(Path(folder).glob("*.safetensors")):
        for k, t in iter_tensors(f, "--model"):
            check_finite({k: t}, f"--model: {f}")


def linear_keys(config: DFlashConfig) -> list[str]:
    """exllamav3's keys of the drafter's quantized Linears, in module order."""
    keys = ["fc"]
    for i in range(config.num_hidden_layers):
        keys += [f"layers.{i}.self_attn.{p}_proj" for p in "qkvo"]
        keys += [f"layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")]
    return keys


def unquantized_keys(config: DFlashConfig) -> list[str]:
    """Tensors exllamav3 keeps as they are: every norm (hidden_norm included)."""
    keys = ["hidden_norm.weight", "norm.weight"]
    for i in range(config.num_hidden_layers):
        keys += [f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight",
                 f"layers.{i}.self_attn.q_norm.weight", f"layers.{i}.self_attn.k_norm.weight"]
    return keys
