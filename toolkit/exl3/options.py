"""The exllamav3 backend's generator options (the levers of issue 16). Exl3Options() is exllamav3's own behaviour
(every lever off); ADOPTED, the backend's default, has on the levers measured to pay and shown lossless.

Four are exllamav3 1.6.5 Generator arguments, passed through unchanged; four are ours (the drafter's two in
exl3_draft_levers: `graph_draft_swa`, `chunked_draft_mlp`):

- `sparse_draft_head` (int, 0 = off): exllamav3's frequency-selected vocabulary subset for the drafter's head
  (the drafter borrows the target's lm_head). Verification keeps the full head, so output is unaffected; it only
  makes the drafter's head cheaper.
- `draft_max_rows` (int, 0 = off): exllamav3's static row ceiling: the verified window is trimmed each round so
  that jobs x (1 + window) stays under it. Our per-concurrency cost table subsumes it (the policy sees what a
  wider window costs at this concurrency); it stays as a lever to compare against.
- `hybrid_draft_tokens` (int, 0 = off): exllamav3's suffix-match drafting: when a job's suffix repeats at least
  this many tokens of its context, the round verifies that many copied tokens instead of the drafter's block.
  On a recurrent target it needs max_history >= the value (our caches keep the drafter's B-1).
- `dynamic_draft_tokens` with `draft_confidence`: exllamav3's own confidence-calibrated truncation of the
  verified window (calibrated online). It is an alternative to our policy, not a complement: with it on, the
  policy does not set the width (each round offers B-1 and exllamav3 cuts it).
- `chunked_verify` (ours): exllamav3's fused MoE decode path (BlockSparseMLP's bsz <= MAX_BSZN = 8 kernels) is
  only taken up to 8 rows; 9..16 rows fall to the generic MoE kernel, measured ~28 % slower per B=16 round on
  the H200. The wrap runs 9..16 rows through the fused path in chunks of <= 8 rows, one after another (32+
  rows were measured slower chunked, so they are left alone). Rows are independent in an MLP, so the output is
  the same up to kernel rounding; adopt it only where greedy output stays identical on trained fixtures.
- `defer_draft_kv` (ours): an AR round (width 0) of the speculative Generator skips the drafter's forward but
  still updates the drafter's K/V from the target's taps for every token (measured 1.09-1.34x an AR step);
  with it on, the policy's AR rounds keep those updates and write a whole AR stretch in one call before the
  drafter runs again (exl3_defer.py). Output is the target's either way; the drafter's K/V are the same up to
  the rounding of its projections at n rows instead of 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..core.errors import ToolkitError

MAX_FUSED_ROWS = 8                 # exllamav3 1.6.5 block_sparse_mlp.MAX_BSZN
CHUNK_ROWS = range(MAX_FUSED_ROWS + 1, 2 * MAX_FUSED_ROWS + 1)   # row counts that chunked_verify splits: 9..16
UNSAFE_PARAMS = ("autosplit_measure", "capture_sens", "capture_qmaps", "activate_all_experts", "tp_warmup")


@dataclass(frozen=True)
class Exl3Options:
    """Generator options of the exllamav3 backend; the defaults are exllamav3's own (every lever off)."""

    sparse_draft_head: int = 0
    draft_max_rows: int = 0
    hybrid_draft_tokens: int = 0
    dynamic_draft_tokens: bool = False
    draft_confidence: float = 0.4
    chunked_verify: bool = False
    defer_draft_kv: bool = False
    graph_draft_swa: bool = False
    chunked_draft_mlp: bool = False

    def __post_init__(self) -> None:
        for name in ("sparse_draft_head", "draft_max_rows", "hybrid_draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ToolkitError(f"{name} must be an integer >= 0, got {v!r}")
        if not 0.0 < float(self.draft_confidence) < 1.0:
            raise ToolkitError(f"draft_confidence must be between 0 and 1, got {self.draft_confidence}")

    def generator_kwargs(self) -> dict:
        """The exllamav3 Generator arguments these options set (only the ones that differ from its defaults)."""
        kw = {k: getattr(self, k) for k in ("sparse_draft_head", "draft_max_rows", "hybrid_draft_tokens") if getattr(self, k)}
        if self.dynamic_draft_tokens:
            kw.update(dynamic_draft_tokens=True, draft_confidence=float(self.draft_confidence))
        return kw

    @property
    def tag(self) -> str:
        """A short name of the non-default options ("stock" when none): cost cache keys and bench cells."""
        d = asdict(self)
        if not self.dynamic_draft_tokens:
            d.pop("draft_confidence")
        parts = [k if v is True else f"{k}={v}" for k, v in d.items() if v != getattr(Exl3Options, k)]
        return ",".join(parts) or "stock"


# The toolkit's defaults on exllamav3 (what generate, bench, eval_tau and the app use unless told otherwise): the
# levers measured faster in the same run and lossless. `--levers graph_draft_swa=off` gives exllamav3's own.
ADOPTED = Exl3Options(graph_draft_swa=True)

LEVERS = {                          # lever name -> the value `--levers NAME` uses when none is given
    "sparse_draft_head": 32768,
    "draft_max_rows": 8,
    "hybrid_draft_tokens": 15,
    "dynamic_draft_tokens": 0.4,    # the value is draft_confidence
    "chunked_verify": True,
    "defer_draft_kv": True,
    "graph_draft_swa": True,
    "chunked_draft_mlp": True,
}
SWITCHES = ("chunked_verify", "defer_draft_kv", "graph_draft_swa", "chunked_draft_mlp")   # only on or off


def parse_lever(text: str, base: Exl3Options | None = None) -> tuple[str, Exl3Options]:
    """"NAME", "NAME=VALUE" or several joined by "+" -> (its label, `base` with those levers on)."""
    opts, labels = base or Exl3Options(), []
    for part in text.split("+"):
        label, change = one_lever(part)
        opts = replace(opts, **change)
        labels.append(label)
    return "+".join(labels), opts


def one_lever(text: str) -> tuple[str, dict]:
    name, _, value = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in LEVERS:
        raise ToolkitError(f"unknown lever {name!r}: choose from {', '.join(LEVERS)}")
    raw = value.strip() or str(LEVERS[name])
    try:
        if name in SWITCHES:
            on = raw.lower() in ("1", "true", "on", "yes")
            if not on and raw.lower() not in ("0", "false", "off", "no"):
                raise ValueError
            change = {name: on}
        elif name == "dynamic_draft_tokens":
            change = {"dynamic_draft_tokens": True, "draft_confidence": float(raw)}
        else:
            change = {name: int(raw)}
    except ValueError:
        raise ToolkitError(f"lever {name}: bad value {raw!r}") from None
    return (f"{name}={raw}" if value.strip() else name), change


# -- chunked_verify ---------------------------------------------------------------------------------------------


def row_chunks(rows: int, size: int = MAX_FUSED_ROWS) -> list[tuple[int, int]]:
    """[start, end) row ranges of at most `size` rows, as even as possible (13 rows -> 7 + 6)."""
    n = -(-rows // size)
    cuts = [rows * k // n for k in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def chunkable(module, params: dict) -> bool:
    """Whether a BlockSparseMLP treats its rows independently here: the fused path exists, no per-row params
    (residual channel, token-hashed routing, multimodal rows), no tensor-parallel or CPU-expert split, no
    calibration pass."""
    if getattr(module, "bc", None) is None or getattr(module, "alt_residual_channel", False):
        return False
    if getattr(module, "tp_reduce", False) or getattr(module, "routing_device", None) is not None:
        return False
    if getattr(module, "cpu_split_first", None) is not None or getattr(module, "cpu_offload", False):
        return False
    if "hash" in getattr(getattr(module, "routing_fn", None), "__name__", "") or params.get("indexed_embeddings"):
        return False                               # routing reads per-row input ids / image rows from params
    return not any(k in params for k in UNSAFE_PARAMS)


class ChunkedForward:
    """A BlockSparseMLP's forward that sends 9..16 rows through the fused path in chunks of <= 8 rows.

    The fused path returns a view of a shared per-layer buffer (experts_cfg.out_bszn), so each chunk's output is
    copied out before the next chunk runs."""

    def __init__(self, module):
        self.module = module
        self.inner = type(module).forward.__get__(module)      # the class's own forward, bound

    def __call__(self, x, params: dict, out_dtype=None):
        rows = x.numel() // x.shape[-1]
        if rows not in CHUNK_ROWS or not chunkable(self.module, params):
            return self.inner(x, params, out_dtype)
        flat = x.reshape(rows, x.shape[-1])
        out = None
        for a, b in row_chunks(rows):
            y = self.inner(flat[a:b].unsqueeze(0), params, out_dtype)
            y = y.reshape(b - a, y.shape[-1])
            if out is None:
                out = y.new_empty((rows, y.shape[-1]))
            out[a:b].copy_(y)
        return out.view(*x.shape[:-1], out.shape[-1])


def set_chunked_verify(model, moe_class: type, on: bool) -> int:
    """Install (on) or remove the chunked forward on every `moe_class` module of `model`; returns how many."""
    return set_forward_wrap(model, moe_class, ChunkedForward, on)


def set_forward_wrap(model, module_class: type, wrap: type, on: bool) -> int:
    """Install (on) or remove `wrap(module)` as the instance forward of every `module_class` module of `model`
    (removing restores the class's own); returns how many such modules there are."""
    n = 0
    for m in model:
        if not isinstance(m, module_class):
            continue
        has = isinstance(vars(m).get("forward"), wrap)
        if on and not has:
            m.forward = wrap(m)
        elif not on and has:
            del m.forward
        n += 1
    return n
