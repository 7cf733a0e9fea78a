"""One CUDA graph per (layer, row count) of an MoE forward whose launches depend on its row count alone (the union
path): the call copies its rows and routing into the graph's static inputs and replays it, one launch instead of
the path's five, so the host keeps ahead of the GPU. A shape's first call runs eagerly (kernels compile and tune),
its second is captured, later ones replay."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
POOL: list = []


def shared_pool_capture(graph):
    """torch.cuda.graph over one memory pool for every graph here: each graph allocates only its output, which it
    keeps, so the graphs never share memory and need no replay order."""
    if not POOL:
        POOL.append(torch.cuda.graph_pool_handle())
    return torch.cuda.graph(graph, pool=POOL[0], capture_error_mode="thread_local")


class Graphed:
    """`forward(x, sel, w) -> out` replayed from CUDA graphs keyed by the inputs' shapes and dtypes."""

    def __init__(self, forward: Forward, capture: Callable | None = None, new_graph: Callable | None = None):
        self.forward = forward
        self.capture = capture or shared_pool_capture    # a context manager taking a graph (tests inject both)
        self.new_graph = new_graph or torch.cuda.CUDAGraph
        self.seen: set = set()
        self.graphs: dict = {}
        self.failed: str | None = None                   # why capturing failed here: eager from then on

    def __call__(self, x: torch.Tensor, sel: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
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
        graph = self.new_graph()
        with self.capture(graph):
            out = self.forward(*static)
        return graph, static, out
