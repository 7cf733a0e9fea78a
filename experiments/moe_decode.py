"""The grouped MoE path's decode for experiments/moe_paths.py (step 2): its Triton decode against exllamav3's
reconstruct kernel, bit for bit, on every codebook and bitrate the converter writes and on a layer's own experts."""

from __future__ import annotations


def random_exl3(codebook: str, K: float, gen):
    import torch
    from exllamav3.modules.quant.exl3 import LinearEXL3

    from toolkit.moe.ref import tile_words

    trellis = torch.randint(-32768, 32768, (16, 16, tile_words(K)), dtype=torch.int16, generator=gen).cuda()
    sign = lambda n: ((torch.randint(0, 2, (n,), generator=gen) * 2 - 1).half()).cuda()
    marker = torch.tensor(1, dtype=torch.int32).cuda()
    return LinearEXL3(None, 256, 256, suh=sign(256), svh=sign(256), trellis=trellis,
                      mcg=marker if codebook == "mcg" else None, mul1=marker if codebook == "mul1" else None)


def check_decode(moe) -> dict:
    import torch

    from toolkit.exl3.moe import exl3_weight
    from toolkit.moe import grouped as gm
    from toolkit.moe.ref import RATES, dense_weight

    gen = torch.Generator().manual_seed(0)
    out, bad = {}, 0
    for cb in ("mul1", "mcg", "3inst"):
        for K in RATES:
            if K != int(K) and cb != "mul1":
                continue
            lin = random_exl3(cb, K, gen)
            ref = lin.get_inner_weight_tensor().view(torch.int16)
            row = {}
            for name, asm in (("ptx", True), ("portable", False)):
                try:
                    row[name] = int((gm.decode_inner(exl3_weight(lin), asm=asm).view(torch.int16) != ref).sum())
                    bad += row[name]
                except Exception as e:                     # a compile failure is a result here, not the end of the run
                    row[name] = f"{type(e).__name__}: {e}"[:300]
                    bad += 1
            row["dense_max_abs"] = float((dense_weight(exl3_weight(lin)).cuda()
                                          - lin.get_weight_tensor().double()).abs().max())
            out[f"{cb}-{K}"] = row
    own = {}
    for e in range(4):
        for name, ms in (("gate", moe.gates), ("up", moe.ups), ("down", moe.downs)):
            lin = ms[e].inner
            own[f"{name}{e}"] = int((gm.decode_inner(exl3_weight(lin)).view(torch.int16)
                                     != lin.get_inner_weight_tensor().view(torch.int16)).sum())
            bad += own[f"{name}{e}"]
    return {"mismatched_weights_total": bad, "formats": out, "layer_experts": own}
