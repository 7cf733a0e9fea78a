"""The per-bitrate table and plot of docs/benchmarks.md (issue 8), rebuilt from the device's raw data.

    python -m experiments.smol_tables docs/smol_2026-12-03.json docs/smol_quant.png

Reads the JSON that collects what calls 2-4 of the SmolLM2 device run returned (quantize report rows: KL, top-1,
tau through the torch runtime; tau of every EXL3 drafter on exllamav3) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(data: dict) -> list[dict]:
    q = data["call3_exl3"]["quantize"]["result"]
    per = data["call4_tau_exl3_per_bitrate"]
    bf16 = data["call3_exl3"]["tau_exl3_bf16"]["result"]["tau"]
    out = [{"bits": "BF16", "calibrated": "-", "size": None, "kl": 0.0, "top1": 1.0, "tau_check": q["bf16_tau"], "exl3": bf16}]
    for r in q["results"]:
        out.append({"bits": r["bits"], "calibrated": "yes" if r["calibrated"] else "no", "size": r["size_bytes"],
                    "kl": r["kl"], "top1": r["top1"], "tau_check": r["tau"], "exl3": per.get(r["folder"])})
    return out


def table(data: dict) -> str:
    rs = rows(data)
    ref = rs[0]["exl3"]
    lines = ["| bits | calibrated | size (MiB) | KL(BF16 ‖ EXL3) | top-1 vs BF16 | tau, check (torch) | "
             "tau chat B=16 (exllamav3) | tau code B=16 (exllamav3) | vs BF16 (chat / code) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        e = r["exl3"]
        chat, code = (e["chat"]["16"], e["code"]["16"]) if e else (None, None)
        rel = (f"{100 * (chat / ref['chat']['16'] - 1):+.1f} % / {100 * (code / ref['code']['16'] - 1):+.1f} %"
               if e and r["bits"] != "BF16" else "-")
        size = f"{r['size'] / 2**20:.1f}" if r["size"] else "-"
        lines.append(f"| {r['bits']} | {r['calibrated']} | {size} | {r['kl']:.4f} | {r['top1']:.3f} | {r['tau_check']:.3f} | "
                     f"{chat if chat is not None else '-'} | {code if code is not None else '-'} | {rel} |")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = rows(data)
    ref = rs[0]["exl3"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for cal, style in (("yes", "-o"), ("no", "--s")):
        sel = [r for r in rs[1:] if r["calibrated"] == cal and r["exl3"]]
        bits = [r["bits"] for r in sel]
        a.plot(bits, [r["top1"] for r in sel], style, label=f"top-1 vs BF16 ({'calibrated' if cal == 'yes' else 'uncalibrated'})")
        for cat, color in (("chat", "tab:blue"), ("code", "tab:orange")):
            b.plot(bits, [r["exl3"][cat]["16"] for r in sel], style, color=color,
                   label=f"{cat}, {'calibrated' if cal == 'yes' else 'uncalibrated'}")
    for cat, color in (("chat", "tab:blue"), ("code", "tab:orange")):
        b.axhline(ref[cat]["16"], color=color, ls=":", lw=1, label=f"{cat}, BF16")
    a.set(xlabel="bits per weight", ylabel="top-1 agreement with the BF16 drafter", title="Drafter outputs vs BF16")
    b.set(xlabel="bits per weight", ylabel="tau at B=16 (tokens per round)", title="Acceptance on exllamav3 (24+24 held-out)")
    a.legend(fontsize=8)
    b.legend(fontsize=7, ncol=2)
    fig.suptitle("SmolLM2-135M DFlash drafter, EXL3 per bitrate (H200, 2026-12-03)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.smol_tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="the collected device data, e.g. docs/smol_2026-12-03.json")
    ap.add_argument("png", help="the plot to write, e.g. docs/smol_quant.png")
    a = ap.parse_args(argv)
    d = json.loads(a.data.read_text())
    print(table(d))
    plot(d, a.png)
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
