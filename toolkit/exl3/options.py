"""The exllamav3 backend's options: the levers of ours measured to pay and shown lossless, on by default.

Exl3Options() is exllamav3's own behaviour; ADOPTED, the backend's default, turns on every adopted lever:

- `graph_draft_swa`: the DFlash drafter's sliding-window layers run through exllamav3's graph-captured decode
  attention (draft_levers.py). Measured 1.0-1.5 ms cheaper per round at c=1 on the real shape, lossless.
- `union_moe`: the target's EXL3 MoE calls of 1-16 rows (an AR step of up to 16 requests, a c=1 verify round)
  decode each expert they touch once for all of their rows, through exllamav3's own multi-matrix GEMM, replayed
  from a CUDA graph per (layer, rows) (toolkit/moe/union.py). On the real shape (H100): c=1 w=7 rounds 15.8 ->
  12.3 ms, AR steps at c = 1 / 4 / 8 1.04x / 1.24x / 1.34x faster; greedy output equal to the stock path's on a
  trained MoE fixture. The first start on a new machine spends a minute or two in exllamav3's GEMM tuner (cached on disk).
- `grouped_moe`: MoE calls of 17-64 rows take an expert-grouped Triton forward (toolkit/moe/grouped.py), each
  touched expert's weights decoded once per block of its rows. On the real shape: verify rounds 7-24 % cheaper at
  16-64 rows; the speculative output equal to the stock path's on a trained MoE fixture.

Not adopted yet (being measured; `--levers forward_graphs`, `--levers packed_moe`):

- `forward_graphs`: the target's whole decode forward (every layer and the LM head, up to 16 tokens per job and
  32 jobs) replayed from one CUDA graph per shape (graphs.py), so the host issues one launch instead of about a
  thousand. exllamav3's own per-module graphs cannot run inside such a capture: start the process with
  EXL3_GRAPHS=0 (exllamav3 then issues the same kernels eagerly and these graphs hold them); otherwise the
  captures fail and the calls stay eager, one log line saying so.
- `packed_moe`: MoE calls of 17-512 rows decode each touched expert once per 8 of its own rows through
  exllamav3's multi-matrix GEMM (toolkit/moe/packed.py), where the union path multiplies every row by every
  touched expert and the grouped path decodes with our own Triton kernels.

Elsewhere (past 64 rows, calibration passes) exllamav3's own MoE forward runs. Without Triton both MoE
levers stay off; the bench JSON says how many MoE calls took which path.

`python -m toolkit.bench --levers grouped_moe=off` measures a lever against exllamav3's own behaviour.
Levers measured and not adopted are listed with their numbers on docs/results.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..core.errors import ToolkitError


@dataclass(frozen=True)
class Exl3Options:
    """Options of the exllamav3 backend; the defaults are exllamav3's own (every lever off)."""

    graph_draft_swa: bool = False
    grouped_moe: bool = False
    union_moe: bool = False
    forward_graphs: bool = False
    packed_moe: bool = False

    @property
    def moe_levers(self) -> bool:
        return self.grouped_moe or self.union_moe or self.packed_moe

    @property
    def tag(self) -> str:
        """A short name of the non-default options ("stock" when none): cost cache keys and bench cells."""
        parts = [k if v is True else f"{k}={v}" for k, v in asdict(self).items() if v != getattr(Exl3Options, k)]
        return ",".join(parts) or "stock"


# The toolkit's defaults on exllamav3 (generate, bench, eval_tau and the app use them unless told otherwise).
ADOPTED = Exl3Options(graph_draft_swa=True, grouped_moe=True, union_moe=True)

LEVERS = {"graph_draft_swa": True, "grouped_moe": True, "union_moe": True, "forward_graphs": True,
          "packed_moe": True}                   # lever -> the value `--levers NAME` uses when none is given


def parse_lever(text: str, base: Exl3Options | None = None) -> tuple[str, Exl3Options]:
    """"NAME", "NAME=on|off" or several joined by "+" -> (its label, `base` with those levers set)."""
    opts, labels = base or Exl3Options(), []
    for part in text.split("+"):
        name, _, value = part.partition("=")
        name = name.strip().replace("-", "_")
        if name not in LEVERS:
            raise ToolkitError(f"unknown lever {name!r}: choose from {', '.join(LEVERS)}")
        raw = value.strip().lower() or "on"
        if raw not in ("1", "true", "on", "yes", "0", "false", "off", "no"):
            raise ToolkitError(f"lever {name}: bad value {value.strip()!r} (on or off)")
        opts = replace(opts, **{name: raw in ("1", "true", "on", "yes")})
        labels.append(f"{name}={value.strip()}" if value.strip() else name)
    return "+".join(labels), opts
