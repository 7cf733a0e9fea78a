"""The exllamav3 backend's memory pre-check, per device: does the target (one GPU, split or tensor-parallel),
its cache and the drafter fit before anything is loaded?

The estimate follows exllamav3's loaders. Layer split (`gpu_split` GB per device, or "auto"): the target's
layers, each with its weights (sizes from the safetensors headers) and its share of the cache, go to the
devices in order, a device filled up to its budget before the next one is used, as `_load_autosplit` does;
weights outside the layers (LM head, norms, and conservatively the embedding) go with the last layer. Tensor
parallel: every device holds its share of the whole target, in proportion to the split. The drafter (weights
and cache) sits whole on its device, loaded first. Each used device also keeps a reserve of 0.5 GiB (CUDA
context, workspaces). `plan_devices` is pure (numbers in, per-device needs out); `check_memory` reads the
folders and the devices' free memory and refuses in one line with the per-device numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ToolkitError
from ..core.target import TargetInfo, read_optional
from ..core.tensorfiles import read_header
from ..mtp.config import PREFIX as MTP_PREFIX          # a target's own MTP head: not loaded with the target
from ..runtime.placement import GpuSplit

GIB = 1024**3
RESERVE = GIB // 2
LAYER = re.compile(r"\.layers\.(\d+)\.")


def weight_bytes(folder: Path) -> int:
    """Bytes the folder's weights take once loaded: EXL3 tensors as stored, unquantized ones as fp16."""
    info = TargetInfo(read_optional(folder / "config.json"))
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    if info.exl3:
        return size
    dtype = str(info.config.get("torch_dtype") or info.config.get("dtype") or "bfloat16")
    return size // 2 if "32" in dtype else size


def layer_cache_bytes(cfg: dict, tokens: int, slots: int) -> list[int]:
    """Cache bytes of each layer: K/V for `tokens` positions on attention layers, recurrent state for `slots` jobs
    on linear-attention ones."""
    t = TargetInfo(cfg).text
    layers = int(t.get("num_hidden_layers", 0))
    types = t.get("layer_types") or ["full_attention"] * layers
    heads = int(t.get("num_attention_heads", 1))
    kv, hd = int(t.get("num_key_value_heads", heads)), int(t.get("head_dim") or t.get("hidden_size", 0) // heads)
    vh, kd, vd = (int(t.get(k, 0)) for k in ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    attn = ("full_attention", "sliding_attention")
    return [2 * kv * hd * 2 * tokens if x in attn else vh * kd * vd * 2 * 2 * slots for x in types]


def cache_bytes(cfg: dict, tokens: int, slots: int) -> int:
    """K/V bytes for `tokens` positions over the attention layers of a config, plus recurrent state for `slots` jobs."""
    return sum(layer_cache_bytes(cfg, tokens, slots))


def header_sizes(path: Path) -> dict[str, tuple[str, int]]:
    """{tensor name: (dtype, stored bytes)} from a safetensors file's header (the data is not read)."""
    head = read_header(path)
    return {k: (v["dtype"], v["data_offsets"][1] - v["data_offsets"][0]) for k, v in head.items() if k != "__metadata__"}


def layer_weight_bytes(folder: Path, layers: int) -> tuple[list[int], int]:
    """(bytes per decoder layer, bytes outside the layers) of a folder's weights once loaded (unquantized F32 as
    fp16);
    without readable headers, the whole size counts as outside the layers."""
    per, rest = [0] * layers, 0
    exl3 = TargetInfo(read_optional(Path(folder) / "config.json")).exl3
    try:
        for f in sorted(Path(folder).glob("*.safetensors")):
            for name, (dtype, size) in header_sizes(f).items():
                if name.startswith(MTP_PREFIX):          # the MTP head: loaded only as the drafter (mtp_bytes)
                    continue
                size = size // 2 if dtype == "F32" and not exl3 else size
                m = LAYER.search(name)
                if m and int(m.group(1)) < layers:
                    per[int(m.group(1))] += size
                else:
                    rest += size
    except ToolkitError:                     # an unreadable header: checked again, in one line, at load
        return [0] * layers, weight_bytes(Path(folder))
    return per, rest


def mtp_bytes(folder: Path, cfg: dict, tokens: int) -> tuple[int, int]:
    """(weights, cache) of a target's own MTP head once loaded as the drafter: its `mtp.` tensors, and K/V for
    `tokens` positions in each of its layers (full attention, the target's heads)."""
    exl3 = TargetInfo(cfg).exl3
    weights = 0
    try:
        for f in sorted(Path(folder).glob("*.safetensors")):
            weights += sum(size // 2 if dtype == "F32" and not exl3 else size
                           for name, (dtype, size) in header_sizes(f).items() if name.startswith(MTP_PREFIX))
    except ToolkitError:                     # an unreadable header: checked again, in one line, at load
        pass
    t = TargetInfo(cfg).text
    layers = int(t.get("mtp_num_hidden_layers") or 0)
    return weights, cache_bytes({**t, "num_hidden_layers": layers, "layer_types": ["full_attention"] * layers}, tokens, 0)


@dataclass
class DeviceNeed:
    """What one GPU holds: the target's share (weights and caches), the drafter, and the device's limits."""

    device: int
    target: int = 0
    draft: int = 0
    layers: tuple[int, int] | None = None     # [first, last] target layers here (layer split)
    budget: int | None = None                 # the split's budget for the target here (None: its free memory)
    free: int = 0

    @property
    def used(self) -> bool:
        return bool(self.target or self.draft)

    @property
    def total(self) -> int:
        return self.target + self.draft + (RESERVE if self.used else 0)

    def line(self) -> str:
        where = f" layers {self.layers[0]}-{self.layers[1]}" if self.layers else ""
        return (f"cuda:{self.device} needs about {gib(self.total)} GiB (target{where} {gib(self.target)}, drafter "
                f"{gib(self.draft)}, reserve 0.5), {gib(self.free)} free")


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def budgets(split: GpuSplit, free: list[int], draft_bytes: int) -> list[int]:
    """The target's budget per device: the split's GB, or ("auto") the free memory less the drafter and reserve."""
    s = split.gpu_split
    if isinstance(s, tuple):
        return [int(gb * GIB) for gb in s[: len(free)]]
    out = [f - RESERVE - (draft_bytes if i == split.draft_device else 0) for i, f in enumerate(free)]
    return [max(0, b) for b in out] if (s == "auto" or split.tensor_parallel) else out[:1]


def plan_devices(layer_sizes: list[int], head: int, draft_bytes: int, split: GpuSplit, free: list[int]) -> list[DeviceNeed]:
    """Per-device needs of a target (bytes per layer incl. its cache, then `head`) and a drafter under `split`,
    given each device's free bytes; a one-line ToolkitError when the target does not fit the split's budgets."""
    split.check_devices(len(free))
    needs = [DeviceNeed(i, free=f) for i, f in enumerate(free)]
    needs[split.draft_device].draft = draft_bytes
    caps = budgets(split, free, draft_bytes)
    total = sum(layer_sizes) + head
    if split.tensor_parallel:
        room = sum(caps)
        if total > room:
            raise ToolkitError(f"the target does not fit {split.tag}: tensor-parallel it needs about {gib(total)} GiB "
                               f"(weights and caches), the split gives {gib(room)} GiB ("
                               + ", ".join(f"cuda:{i} {gib(b)}" for i, b in enumerate(caps)) + ")")
        for i, b in enumerate(caps):
            needs[i].target, needs[i].budget = -(-total * b // room), b
        return needs
    if split.default:                           # one GPU: everything on device 0, whatever its free memory
        needs[0].target, needs[0].layers = total, (0, len(layer_sizes) - 1) if layer_sizes else None
        return needs
    dev, items = 0, [*layer_sizes, head]
    for k, size in enumerate(items):
        while dev < len(caps) and needs[dev].target + size > caps[dev]:
            dev += 1
        if dev >= len(caps):
            placed = ", ".join(f"cuda:{n.device} {gib(n.target)} of {gib(c)}" for n, c in zip(needs, caps))
            what = f"layer {k}" if k < len(layer_sizes) else "its LM head"
            raise ToolkitError(f"the target does not fit {split.tag}: {gib(total)} GiB of weights and caches, "
                               f"{what} has no room left ({placed} GiB used)")
        n = needs[dev]
        n.target += size
        n.budget = caps[dev]
        if k < len(layer_sizes):
            n.layers = (n.layers[0] if n.layers else k, k)
    return needs


def device_free(count: int) -> list[int]:
    """Free bytes of GPUs 0..count-1."""
    import torch

    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(count)]


def check_memory(target: Path, draft: Path | None, tokens: int, slots: int, gpu: str,
                 split: GpuSplit | None = None, free: list[int] | None = None, mtp: bool = False) -> list[DeviceNeed]:
    """Refuse to load, in one line, when the weights and caches plainly do not fit the free GPU memory (per device
    when the target is split, its drafter elsewhere, or tensor-parallel); returns the per-device estimate. With
    `mtp` the drafter is the target's own MTP head."""
    split = split or GpuSplit()
    if free is None:
        from ..runtime.placement import device_count

        free = device_free(1 if split.default else device_count())
    tcfg = read_optional(Path(target) / "config.json")
    cache = layer_cache_bytes(tcfg, tokens, slots)
    wl, head = layer_weight_bytes(Path(target), len(cache))
    dw = dc = 0                              # the drafter's weights and cache
    if draft:
        dw, dc = weight_bytes(Path(draft)), cache_bytes(read_optional(Path(draft) / "config.json"), tokens, slots)
    elif mtp:
        dw, dc = mtp_bytes(Path(target), tcfg, tokens)
    needs = plan_devices([w + c for w, c in zip(wl, cache)], head, dw + dc, split, free)
    short = [n for n in needs if n.used and n.total > n.free]
    if short and split.default:
        w, c = sum(wl) + head + dw, sum(cache) + dc
        raise ToolkitError(f"not enough GPU memory on {gpu}: loading needs about {gib(needs[0].total)} GiB (weights "
                           f"{gib(w)}, caches of {tokens} tokens {gib(c)}, reserve 0.5), {gib(free[0])} GiB is free")
    if short:
        raise ToolkitError(f"not enough GPU memory for {split.tag}: " + "; ".join(n.line() for n in needs if n.used))
    return needs
