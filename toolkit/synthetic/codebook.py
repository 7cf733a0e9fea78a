"""A small CPU reference decoder for EXL3 linears (exllamav3 1.6.5), written from reading its CUDA source.

Storage of one linear y = x @ W, W of shape (in, out), both padded to multiples of 128:

- `trellis` int16 [in/16, out/16, 16*K]: one 16x16 tile of the inner weight per entry, 256*K bits. Read
  as little-endian uint32 words, the tile is a bitstream taken most significant bit first; position t
  (0..255) owns bits [t*K, (t+1)*K) and its 16-bit trellis state is the window of 16 bits that ends
  there, wrapping around the tile (tail-biting). Positions are in tensor-core order: position t holds
  row-major tile element `tensor_core_perm()[t]`.
- the state becomes a number through a procedural codebook: `mul1` (the converter's default), `mcg`
  or `3inst` (no marker tensor). The marker tensors `.mul1` / `.mcg` are int32 scalars of the multiplier.
- `suh` fp16 [in], `svh` fp16 [out]: W = svh * H_n(suh * H_k(W_inner)), H a 128-block Hadamard
  (Sylvester order, 1/sqrt(128)) applied along that axis.
"""

from __future__ import annotations

import math

import torch

from .inputs import CODEBOOKS

MUL1_MULT = 0x83DCD12D
MCG_MULT = 0xCBAC1FED
INST3_MULT, INST3_ADD = 89226354, 64248484
HAD = 128
_U32 = 0xFFFFFFFF


def _f16(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16).item()


MUL1_K_INV = _f16(0x1EEE)     # 1/147.77: a sum of four uniform bytes has std 147.8
MUL1_BIAS = _f16(0xC931)      # -(1024 + 510) * k_inv: centres that sum


def marker_value(codebook: str) -> int | None:
    """The int32 value stored in the `.mul1` / `.mcg` marker tensor (None for 3inst, which has no marker)."""
    mult = {"mul1": MUL1_MULT, "mcg": MCG_MULT}.get(codebook)
    return None if mult is None else mult - (1 << 32) if mult >= 1 << 31 else mult


def _halves_sum(x: torch.Tensor) -> torch.Tensor:
    # (x & 0x8fff8fff) ^ 0x3b603b60 as two fp16 bit patterns, added in fp16 (exact in float64, one rounding)
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).double()
    hi = ((x >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16).double()
    return (lo + hi).half()


def decode_states(states: torch.Tensor, codebook: str = "mul1") -> torch.Tensor:
    """fp16 codebook values of 16-bit trellis states (any integer tensor, values 0..65535)."""
    s = states.to(torch.int64) & 0xFFFF
    if codebook == "mul1":
        p = (s * MUL1_MULT) & _U32
        total = (p & 255) + ((p >> 8) & 255) + ((p >> 16) & 255) + ((p >> 24) & 255)
        return ((1024 + total).double() * MUL1_K_INV + MUL1_BIAS).half()
    if codebook == "mcg":
        return _halves_sum((s * MCG_MULT) & _U32)
    if codebook == "3inst":
        return _halves_sum((s * INST3_MULT + INST3_ADD) & _U32)
    raise ValueError(f"codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")


def codebook_table(codebook: str = "mul1") -> torch.Tensor:
    """All 65536 codebook values, indexed by state."""
    return decode_states(torch.arange(65536), codebook)


def tensor_core_perm() -> torch.Tensor:
    """Row-major tile element of each trellis position (the 16x16 tensor-core fragment order)."""
    perm = []
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        for r, c in ((r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0),
                     (r0, c0 + 8), (r0 + 1, c0 + 8), (r0 + 8, c0 + 8), (r0 + 9, c0 + 8)):
            perm.append(r * 16 + c)
    return torch.tensor(perm, dtype=torch.long)


def tile_bits(tiles: torch.Tensor) -> torch.Tensor:
    """Bitstreams [..., 256*K] (0/1, int64) of packed tiles [..., 16*K] int16, most significant bit first."""
    u16 = tiles.to(torch.int32) & 0xFFFF
    words = (u16[..., 1::2] << 16) | u16[..., 0::2]       # little-endian uint32 pairs
    shifts = torch.arange(31, -1, -1)
    return ((words.to(torch.int64).unsqueeze(-1) >> shifts) & 1).flatten(-2)


def tile_states(tiles: torch.Tensor, K: int) -> torch.Tensor:
    """16-bit trellis state of each of the 256 positions of packed tiles [..., 16*K]: [..., 256]."""
    bits = tile_bits(tiles)
    n = 256 * K
    ends = (torch.arange(256) + 1) * K
    idx = (ends.unsqueeze(1) - 16 + torch.arange(16)) % n              # window bits, MSB first
    win = bits[..., idx]                                               # [..., 256, 16]
    return (win << torch.arange(15, -1, -1)).sum(-1)


def pack_tiles(symbols: torch.Tensor, K: int) -> torch.Tensor:
    """Pack K-bit symbols [..., 256] (tensor-core order) the way exllamav3's pack_trellis kernel does:
    MSB-first into uint16 words, then the two halves of every uint32 swapped. Returns int16 [..., 16*K]."""
    sym = symbols.to(torch.int64) & ((1 << K) - 1)
    bits = ((sym.unsqueeze(-1) >> torch.arange(K - 1, -1, -1)) & 1).flatten(-2)          # [..., 256*K]
    u16 = (bits.unflatten(-1, (16 * K, 16)) << torch.arange(15, -1, -1)).sum(-1)
    u16 = u16.unflatten(-1, (8 * K, 2)).flip(-1).flatten(-2)                               # SWAP16
    return u16.to(torch.int32).to(torch.int16)


def hadamard(n: int = HAD) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n (a power of two), float64, unnormalised."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def inner_weight(trellis: torch.Tensor, codebook: str = "mul1") -> torch.Tensor:
    """The rotated-basis weight (in, out) float64 of a trellis [in/16, out/16, 16*K]."""
    tk, tn, words = trellis.shape
    K = words // 16
    vals = decode_states(tile_states(trellis, K), codebook).double()        # [tk, tn, 256], tensor-core order
    tiles = torch.empty_like(vals)
    tiles[..., tensor_core_perm()] = vals
    return tiles.view(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


def decode_linear(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str = "mul1") -> torch.Tensor:
    """The original-basis weight W (in, out), float64: y = x @ W."""
    w = inner_weight(trellis, codebook)
    k, n = w.shape
    h = hadamard() / math.sqrt(HAD)
    w = (h @ w.view(k // HAD, HAD, n)).view(k, n)
    w = w * suh.double().unsqueeze(1)
    w = (w.view(k, n // HAD, HAD) @ h).view(k, n)
    return w * svh.double().unsqueeze(0)
