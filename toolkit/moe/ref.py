"""A torch reference of exllamav3 1.6.5's EXL3 decode and of an EXL3 MoE layer's forward: the oracle of the
MoE paths (grouped.py, union.py) in tests and on the device. Its inputs are the plain ones of weights.py.

An EXL3 linear y = x @ W (W of shape (in, out), both multiples of 128) is stored as:

- `trellis` int16 [in/16, out/16, words]: one 16x16 tile of the inner weight per entry. Read as little-endian
  uint32 words, a tile is a ring of 16*K bits taken most significant bit first; position p (0..255, tensor-core
  order) owns the next D(p) bits (D = K, or for the half rates 1.5/2.5/3.5 of the mul1 codebook KA bits on even
  and KA+1 on odd positions) and its 16-bit trellis state is the window of 16 bits ending there, wrapping around.
- a procedural codebook turns the state into an fp16 value: 3INST, MCG or MUL1 (synthetic/codebook.py).
- `suh` fp16 [in] and `svh` fp16 [out]: W = diag(suh) H W_inner H diag(svh), H the 128-block Hadamard
  (Sylvester order, 1/sqrt(128)); exllamav3 multiplies as y = had(had(x * suh) @ W_inner) * svh.
"""

from __future__ import annotations

import math

import torch

from ..synthetic.codebook import decode_states, hadamard, tensor_core_perm, tile_bits
from .weights import Exl3Weight, MoeLayer

HAD = 128
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}
HALF_RATES = (1.5, 2.5, 3.5)          # mul1 only
RATES = tuple(range(1, 9)) + HALF_RATES


def codebook_of(lin: Exl3Weight) -> str:
    """The codebook name of an EXL3 weight."""
    return "mul1" if lin.mul1 else "mcg" if lin.mcg else "3inst"


def split_rate(K: float) -> tuple[int, int]:
    """(KA, HALF): the integer bits per position and whether odd positions carry one more."""
    ka = int(K)
    if not (1 <= ka <= 8 and (K == ka or (K - ka == 0.5 and ka <= 3))):
        raise ValueError(f"unsupported EXL3 bitrate {K}: 1..8 or 1.5 / 2.5 / 3.5")
    return ka, int(K != ka)


def tile_words(K: float) -> int:
    """int16 words per 256-weight tile."""
    ka, half = split_rate(K)
    return 16 * ka + 8 * half


def window_ends(K: float) -> torch.Tensor:
    """The ring bit where each position's 16-bit window ends (exclusive), [256]."""
    ka, half = split_rate(K)
    p1 = torch.arange(256) + 1
    return p1 * ka + half * (p1 // 2)


def tile_states(tiles: torch.Tensor, K: float) -> torch.Tensor:
    """16-bit trellis state of each position of packed tiles [..., words]: [..., 256] int64."""
    bits = tile_bits(tiles)
    idx = (window_ends(K).unsqueeze(1) - 16 + torch.arange(16)) % bits.shape[-1]
    return (bits[..., idx] << torch.arange(15, -1, -1)).sum(-1)


def inner_weight(trellis: torch.Tensor, K: float, codebook: str) -> torch.Tensor:
    """The rotated-basis weight (in, out) fp16 that exllamav3's reconstruct kernel writes."""
    tk, tn, _ = trellis.shape
    vals = decode_states(tile_states(trellis.cpu(), K), codebook)           # [tk, tn, 256], tensor-core order
    tiles = torch.empty_like(vals)
    tiles[..., tensor_core_perm()] = vals
    return tiles.view(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


def dense_weight(lin: Exl3Weight) -> torch.Tensor:
    """The original-basis weight W (in, out) float64 of an EXL3 weight: y = x @ W."""
    w = inner_weight(lin.trellis, lin.K, codebook_of(lin)).double()
    k, n = w.shape
    h = hadamard(HAD) / math.sqrt(HAD)
    w = (h @ w.view(k // HAD, HAD, n)).view(k, n) * lin.suh.cpu().double().unsqueeze(1)
    return (w.view(k, n // HAD, HAD) @ h).view(k, n) * lin.svh.cpu().double().unsqueeze(0)


def random_linear(k: int, n: int, K: float, codebook: str, gen: torch.Generator, scale: float = 0.05,
                  device: str = "cpu") -> Exl3Weight:
    """An EXL3 linear with random trellis bits (every bit pattern is a valid tensor) and random-sign scales."""
    words = tile_words(K)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, words), dtype=torch.int16, generator=gen)
    suh = (torch.randint(0, 2, (k,), generator=gen) * 2 - 1).half() * scale
    svh = (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).half()
    return Exl3Weight(trellis.to(device), suh.to(device), svh.to(device), K, codebook == "mcg", codebook == "mul1")


def random_layer(hidden: int, inter: int, experts: int, K: float, codebook: str, seed: int = 0,
                 shared: bool = True, gated_shared: bool = True, device: str = "cpu") -> MoeLayer:
    """A random EXL3 MoE layer (every tensor in one format)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda a, b: random_linear(a, b, K, codebook, g, device=device)
    trip = [(mk(hidden, inter), mk(hidden, inter), mk(inter, hidden)) for _ in range(experts)]
    sh = (mk(hidden, inter), mk(hidden, inter), mk(inter, hidden)) if shared else None
    sg = (torch.randn(hidden, generator=g) * 0.05).half().to(device) if shared and gated_shared else None
    return MoeLayer([t[0] for t in trip], [t[1] for t in trip], [t[2] for t in trip], sh, sg)


def ref_mlp(x: torch.Tensor, gate, up, down, cache: dict) -> torch.Tensor:
    """silu(x @ Wg) * (x @ Wu) @ Wd in float64, dense weights cached by object id."""
    w = [cache.setdefault(id(m), dense_weight(m)) for m in (gate, up, down)]
    g, u = x @ w[0], x @ w[1]
    return (g * torch.sigmoid(g) * u) @ w[2]


def ref_moe(x: torch.Tensor, sel: torch.Tensor, weights: torch.Tensor, layer: MoeLayer,
            cache: dict | None = None) -> torch.Tensor:
    """The layer's output for rows x [R, hidden] routed to sel [R, k] with weights [R, k]: float64 [R, hidden]."""
    cache = {} if cache is None else cache
    x = x.detach().cpu().half().double()
    sel, weights = sel.cpu(), weights.cpu().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in sel.unique().tolist():
        rows, slots = (sel == e).nonzero(as_tuple=True)
        y = ref_mlp(x[rows], layer.gates[e], layer.ups[e], layer.downs[e], cache)
        out.index_add_(0, rows, y * weights[rows, slots].unsqueeze(1))
    if layer.shared is not None:
        y = ref_mlp(x, *layer.shared, cache)
        if layer.shared_gate is not None:
            y = y * torch.sigmoid(x @ layer.shared_gate.cpu().double()).unsqueeze(1)
        out += y
    return out
