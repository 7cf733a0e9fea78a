"""The torch backend: any transformers causal LM as target, the reference DFlash module as drafter.

It is the CPU reference that the exllamav3 backend is checked against. Rollback after a rejection crops
the target's KV cache; a target with recurrent layers (Qwen3.5/3.6 Gated DeltaNet) cannot be cropped,
so its cache is snapshotted before each verify and the accepted tokens are replayed from the snapshot.

With block_size "auto" (the default) the drafting policy (toolkit/policy) picks each round's width; it may
pick 0, a plain AR round. Such a round still keeps the target's tap hidden states (the drafter needs them
later as context), taken by forward hooks on the tap layers only (`TapHooks`; transformers' output_hidden_states
where the layout is not the usual one), and it does not run the drafter: the taps wait in a backlog that is
added to the drafter's context in one call before the next draft.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..dflash import DFlashConfig, DFlashDraft, DraftCache, gather_taps, load_drafter
from ..core.errors import ToolkitError
from ..core.target import TargetInfo
from .backend import Backend, GenSettings
from .hf import load_hf_model, load_hf_tokenizer  # noqa: F401  (the backend's loaders)
from .pair import ModelPair
from .registry import capabilities
from .events import Round
from .loop import decode
from ..policy.chooser import Policy
from .policy_book import CostKey, PolicyBook
from ..costs.cache import cost_key, device_name
from ..costs.table import CostTable
from .sampling import Sampler

TIMED_ROUNDS = 5        # rounds per width a cost table takes the median of
CHECK_ROUNDS = 3        # rounds per width a cached table is checked against
BACKLOG_MAX = 256       # taps of this many accepted tokens at most wait for the drafter (AR rounds of a policy)


def tap_selection(drafter: DFlashDraft) -> list[int] | bool:
    """output_hidden_states for the drafter's taps: their indices where transformers selects hidden states by
    index (the others come back as None, so gather_taps indexes as before), else True (all of them)."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401  (recent 5.x)
    except ImportError:
        return True
    return sorted(set(tap_indices(drafter)))


def tap_indices(drafter: DFlashDraft) -> list[int]:
    """The drafter's taps as indices into transformers' hidden_states, in gather_taps' order."""
    cfg = drafter.config
    return [L + cfg.tap_shift + 1 for L in cfg.target_layer_ids]


class TapHooks:
    """Forward hooks that keep the outputs of the target's tap layers during `forward`, idle otherwise.

    hidden_states[i] of transformers is decoder layer i-1's output and, for i = num_layers, the final norm's
    (the last hidden state is tied to the normed output). The hooks sit on those modules only and stay installed
    on the target (one set per tap list, shared by all steps on it): an AR round then costs a plain step plus one
    Python call per tap, not the output_hidden_states machinery on every layer (tests check both agree).
    """

    def __init__(self, modules: dict[int, torch.nn.Module]):
        self.local = threading.local()
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in modules.items()]

    def _hook(self, index: int):
        def hook(module, args, output):
            sink = getattr(self.local, "sink", None)
            if sink is not None:
                sink[index] = output[0] if isinstance(output, tuple) else output
        return hook

    @classmethod
    def of(cls, target, indices: Sequence[int]) -> "TapHooks | None":
        """The hooks for `indices` on `target` (installed at first use), or None where its layout is not the
        usual decoder (`layers` and a final `norm`) or an index is the embedding output."""
        cache = target.__dict__.setdefault("_dflash_tap_hooks", {})
        key = tuple(sorted(set(indices)))
        if key not in cache:
            base = target.get_decoder() if hasattr(target, "get_decoder") else None
            layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
            n = len(layers) if isinstance(layers, torch.nn.ModuleList) else 0
            ok = n and isinstance(norm, torch.nn.Module) and all(1 <= i <= n for i in key)
            cache[key] = cls({i: (norm if i == n else layers[i - 1]) for i in key}) if ok else None
        return cache[key]

    def forward(self, fn, indices: Sequence[int]):
        """fn()'s output and the captured hidden states at `indices`, in that order."""
        self.local.sink = sink = {}
        try:
            out = fn()
        finally:
            self.local.sink = None
        return out, [sink[i] for i in indices]


class TorchSteps:
    """Prefill / draft / verify / accept for one sequence on a transformers target."""

    def __init__(self, target, drafter: DFlashDraft | None):
        from transformers import DynamicCache

        self.target, self.drafter = target, drafter
        self.cache = DynamicCache(config=target.config)
        self.cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        types = getattr(target.config, "layer_types", None) or []
        self.recurrent = any(t not in ("full_attention", "sliding_attention") for t in types)
        self.draft_cache = DraftCache(drafter) if drafter is not None else None
        self.taps = tap_indices(drafter) if drafter is not None else []
        self.hooks = TapHooks.of(target, self.taps) if drafter is not None else None
        self.hidden = tap_selection(drafter) if drafter is not None and self.hooks is None else False
        self.backlog: list[list[torch.Tensor]] = []   # taps of accepted tokens not yet in the drafter's context
        self.backlog_len = 0
        self.pos = 0
        self._pending: tuple[list[int], list[torch.Tensor] | None] | None = None
        self._snapshot = None

    def _forward(self, ids: list[int], capture: bool = False):
        """The target's output over `ids` and, with `capture` and a drafter, the tap hidden states [1, len, h] each
        (one tensor of all taps where transformers collects them)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        kw = {self.cache_arg: self.cache}
        if not capture or self.drafter is None:
            return self.target(input_ids=x, use_cache=True, **kw), None
        if self.hooks is not None:
            return self.hooks.forward(lambda: self.target(input_ids=x, use_cache=True, **kw), self.taps)
        out = self.target(input_ids=x, use_cache=True, output_hidden_states=self.hidden, **kw)
        return out, [gather_taps(out.hidden_states, self.drafter.config)]

    def _keep(self, taps: list[torch.Tensor] | None) -> None:
        """Queue the taps of accepted tokens for the drafter's context (added at the next draft)."""
        if taps is None or taps[0].shape[1] == 0:
            return
        self.backlog.append(taps)
        self.backlog_len += taps[0].shape[1]
        if self.backlog_len >= BACKLOG_MAX:
            self.flush()

    def flush(self) -> None:
        """Extend the drafter's context by every queued token, in one call."""
        if self.backlog:
            cols = [col[0] if len(col) == 1 else torch.cat(col, 1) for col in zip(*self.backlog)]
            self.drafter.extend(self.draft_cache, cols[0] if len(cols) == 1 else torch.cat(cols, -1))
            self.backlog, self.backlog_len = [], 0

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        out, taps = self._forward(prompt_ids, capture=True)
        self.pos = len(prompt_ids)
        self._keep(taps)
        return out.logits[0, -1]

    @torch.no_grad()
    def draft_block(self, token: int, width: int) -> list[int]:
        self.flush()
        emb = self.target.get_input_embeddings().weight
        h = self.drafter.draft_hidden(self.draft_cache, torch.tensor([token], device=emb.device), emb)
        logits = self.target.get_output_embeddings()(h[:, 1 : 1 + width].to(emb.dtype))
        return logits[0].argmax(-1).tolist()

    @torch.no_grad()
    def verify(self, block: list[int]) -> torch.Tensor:
        self._snapshot = copy.deepcopy(self.cache) if self.recurrent and len(block) > 1 else None
        out, taps = self._forward(block, capture=True)
        self._pending = (block, taps)
        return out.logits[0]

    @torch.no_grad()
    def accept(self, n: int) -> None:
        block, taps = self._pending
        if n < len(block):
            if self._snapshot is not None:          # recurrent state: restore and replay the kept tokens
                self.cache = self._snapshot
                self._forward(block[:n])
            else:
                self.cache.crop(-(len(block) - n))   # negative = tokens to drop, in transformers 4.x and 5.x
            taps = [t[:, :n] for t in taps] if taps is not None else None
        self.pos += n
        self._keep(taps)
        self._pending = self._snapshot = None


def measure_steps(steps, prompt_ids: list[int], block_size: int, widths: Iterable[int], reps: int = 5,
                  sync: Callable[[], None] = lambda: None,
                  stat: Callable[[list[float]], float] = statistics.median) -> dict[int, float]:
    """ms of one round per verify width (`stat` over reps): draft B-1 (w > 0), verify w+1, accept 1. Widths are
    interleaved after one warm-up pass, so drift spreads evenly; `stat=min` drops rounds other processes slowed."""
    widths = sorted(set(widths) | {0})
    sampler = Sampler()
    token = sampler(steps.prefill(prompt_ids))[-1]
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(reps + 1):
        for w in widths:
            sync()
            t0 = time.perf_counter()
            drafts = steps.draft_block(token, block_size - 1)[:w] if w else []
            picks = sampler(steps.verify([token] + drafts))
            steps.accept(1)
            sync()
            if rep:
                times[w].append((time.perf_counter() - t0) * 1000.0)
            token = picks[0]
    return {w: stat(ts) for w, ts in times.items()}


def measure_torch_costs(target, drafter: DFlashDraft | None, block_size: int | None = None, context: int = 32,
                        reps: int = 5, widths: Iterable[int] | None = None,
                        stat: Callable[[list[float]], float] = statistics.median,
                        make_steps: Callable[[], TorchSteps] | None = None) -> CostTable:
    """Time rounds of a transformers target + reference drafter (one sequence: c = 1); every width by default.
    `make_steps`: the steps to time (another drafter's; default TorchSteps over `drafter`)."""
    B = block_size or drafter.config.block_size
    vocab = int(target.get_input_embeddings().weight.shape[0])
    prompt = [(7 * i + 3) % vocab for i in range(context)]
    dev = target.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    steps = make_steps() if make_steps is not None else TorchSteps(target, drafter)
    ms = measure_steps(steps, prompt, B, range(B) if widths is None else widths, reps, sync, stat)
    return CostTable({1: ms}, device_name(dev), "timed now", counts={1: {w: reps for w in ms}}, timed_at=time.time())


class TorchCosts:
    """The torch backend's round costs for its PolicyBook: ms per round for each verify width on this target,
    drafter and device, the median of TIMED_ROUNDS rounds each, timed once for every job count (one sequence runs
    at a time) and cached on disk when the model folders are known (a cached table is checked against AR and the
    widest width now)."""

    per_concurrency = False

    def __init__(self, be: TorchBackend):
        self.be = be

    def key(self) -> CostKey:
        be = self.be
        return CostKey(f"{be.target.device}|{be.target.dtype}", tuple(map(str, be.folders)))

    def file_key(self, concurrency: int) -> str | None:
        be = self.be
        return cost_key(be.folders, be.target.device, be.target.dtype, be.block_size) if be.folders else None

    def timed(self, widths: Iterable[int], reps: int = TIMED_ROUNDS) -> CostTable:
        be = self.be
        return measure_torch_costs(be.target, be.drafter, be.block_size, reps=reps, widths=widths,
                                   make_steps=lambda: be.steps(True))

    def measure(self, concurrency: int) -> CostTable:
        B = self.be.block_size
        return self.timed(sorted({0, 1, 2, 3, B - 1} | {1 << k for k in range(B.bit_length()) if 1 << k < B}))

    def check(self, concurrency: int) -> dict[int, dict[int, float]]:
        return self.timed((0, self.be.block_size - 1), CHECK_ROUNDS).ms


class TorchBackend(Backend):
    """Backend over a transformers target and an optional reference drafter.

    With block_size "auto" it decodes under a drafting policy kept in its PolicyBook: the cost table is timed at
    first use (`measure_torch_costs`, cached on disk per model folders, device and dtype when the folders are
    known; the policy then corrects it by the rounds' observed times) unless `costs` is given (taken as is), and
    one policy learns greedy acceptance, another sampled acceptance, across generate calls. speculative=False is
    always the plain AR loop, without drafter or hidden states.
    """

    name = "torch"
    caps = capabilities("torch")

    def __init__(self, target, tokenizer, drafter: DFlashDraft | None = None, costs: CostTable | None = None,
                 folders: Sequence[str | Path] = ()):
        self.target, self.tokenizer, self.drafter = target.eval(), tokenizer, drafter
        info = TargetInfo.of_model(target, tokenizer)
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.max_context, self.eos_ids = info.max_context, info.eos_ids
        self.folders = tuple(folders)
        # a measured table is corrected by observed rounds, a given one not
        self.book = PolicyBook(self.block_size, TorchCosts(self), learn=costs is None)
        if costs is not None:
            self.book.give(costs)

    @classmethod
    def from_dirs(cls, target: str | Path, draft: str | Path | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, pair: ModelPair | None = None) -> "TorchBackend":
        """Load a local target folder (transformers) and drafter folder (upstream layout), checked against each
        other (`pair`: already read and checked)."""
        pair = pair or ModelPair.read(target, draft)
        drafter = load_drafter(pair.draft, dtype=dtype, device=device) if pair.draft is not None else None
        folders = pair.folders if pair.draft is not None else ()
        model = load_hf_model(pair.target, device, dtype, info=pair.info)
        return cls(model, load_hf_tokenizer(pair.target), drafter, folders=folders)

    @classmethod
    def load(cls, pair: ModelPair, *, device: str = "cpu", dtype=None, options=None, split=None,
             max_chunk: int | None = None, **engine) -> "TorchBackend":
        """The factory's entry: the common load arguments, refusing those of an engine with levers or placement
        (never ignoring them); cache sizing (`engine`) has no meaning here."""
        if options is not None and options.tag != "stock":
            raise ToolkitError(f"generator options ({options.tag}) need a backend with levers (--backend exllamav3)")
        if max_chunk is not None:
            raise ToolkitError("max_chunk is an exllamav3 load option; the torch backend takes none")
        return cls.from_dirs(pair.target, pair.draft, device=device, dtype=dtype or torch.float32, pair=pair)

    def policy(self, greedy: bool) -> Policy:
        """The auto policy of greedy or sampled decoding (acceptance differs), made at first use."""
        return self.book.policy(greedy)

    def prepare(self, settings: GenSettings, concurrency: int = 1) -> None:
        if settings.auto and self.draft_width(settings, True):
            self.policy(settings.temperature == 0)

    def steps(self, drafting: bool) -> TorchSteps:
        """The steps of one sequence: with the drafter when the decode drafts, the target alone otherwise."""
        return TorchSteps(self.target, self.drafter if drafting else None)

    def generate(self, prompt_ids: list[int], settings: GenSettings, speculative: bool = True) -> Iterator[Round]:
        self.check_prompts([prompt_ids], settings.max_new_tokens)
        width = self.draft_width(settings, speculative)
        drive = self.book.request(settings.temperature == 0) if width and settings.auto else None
        steps = self.steps(bool(width))
        sampler = Sampler(settings.temperature, settings.seed)
        yield from decode(steps, list(prompt_ids), settings.max_new_tokens, sampler, set(self.stop_ids(settings)),
                          width, drive)
