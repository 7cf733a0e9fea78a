"""One CUDA graph per (layer, row count) of an MoE forward whose launches depend on its row count alone (the union
path): the call copies its rows and routing into the graph's static inputs and replays it, one launch instead of
the path's five, so the host keeps ahead of the GPU. A shape's first call runs eagerly (kernels compile and tune,
scratch takes its size), its second is captured, later ones replay. The forward writes into a static output made
before the capture, so a capture allocates nothing."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Forward = Callable[..., torch.Tensor]          # forward(x, sel, w, out=None) -> out


def capture(graph):
    return torch.cuda.graph(graph, capture_error_mode="thread_local")


class Graphed:
    """`forward(x, sel, w) -> out` replayed from CUDA graphs keyed by the inputs' shapes and dtypes."""

    def __init__(self, forward: Forward, capture: Callable | None = None, new_graph: Callable | None = None):
        self.forward = forward
        self.capture = capture or globals()["capture"]   # a context manager taking a graph (tests inject both)
        self.new_graph = new_graph or torch.cuda.CUDAGraph
        self.seen: set = set()
        self.graphs: dict = {}
        self.failed: str | None = None                   # why capturing failed here: eager from then on

    def __call__(self, x: torch.Tensor, sel: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward(x, sel, w)               # inside a whole-forward capture: its kernels join it
        key = (x.shape, x.dtype, sel.shape, sel.dtype, w.shape, w.dtype, x.device)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen or self.failed:      # first call: eager (compiles, autotunes)
                self.seen.add(key)
                return self.forward(x, sel, w)
            try:
                entry = self.graphs[key] = self.record(x, sel, w)
            except Exception as e:                       # a kernel that cannot be captured: eager, said once
                self.failed = f"{type(e).__name__}: {e}"[:300]
                warnings.warn(f"MoE graphs off: {self.failed}")
                return self.forward(x, sel, w)
        graph, (xs, ss, ws), out = entry
        xs.copy_(x)
        ss.copy_(sel)
        ws.copy_(w)
        graph.replay()
        return out.clone()

    def record(self, x: torch.Tensor, sel: torch.Tensor, w: torch.Tensor):
        static = (x.clone(), sel.clone(), w.clone())
        out = self.forward(*static)                      # eager once more: the static output, scratch in place
        graph = self.new_graph()
        with self.capture(graph):
            self.forward(*static, out=out)
        return graph, static, out
