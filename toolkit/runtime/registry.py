"""The backends the toolkit knows, by name, and what each can do. A backend is named here by where its class
lives and imported only when chosen, so this package imports no engine; consumers read `capabilities(name)`
instead of comparing names. What a backend can do is declared here too (its class's `caps` is that entry), so
asking it imports no engine and no torch: a command refuses what a backend cannot take before anything heavy loads."""

from __future__ import annotations

import importlib
from dataclasses import replace

from ..core.errors import OptionError, ToolkitError
from .backend import Backend, Capabilities

BACKENDS = {"torch": "toolkit.runtime.torch_backend:TorchBackend", "exllamav3": "toolkit.exl3.backend:Exl3Backend"}
# a backend's levers (a module with its options' ADOPTED defaults, LEVERS and parse_lever), light to import
LEVERS = {"exllamav3": "toolkit.exl3.options"}
# a backend whose drafting with the target's own MTP head (`--draft mtp`) lives in a class of its own
MTP_CLASSES = {"torch": "toolkit.runtime.torch_mtp:MtpTorchBackend"}
# what each backend can do (levers: its LEVERS module's options class, filled in by `capabilities`)
CAPS = {"torch": Capabilities(unquantized=True),
        "exllamav3": Capabilities(batching=True, gpu_only=True, precision="float16", placement=True, cache_tokens=True,
                                  width_multiple=128, engine="ExLlamaV3")}


def known(name: str) -> str:
    """`name` when it names a backend; one-line error naming the choices otherwise."""
    if name not in BACKENDS:
        raise ToolkitError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def backend_class(name: str, mtp: bool = False) -> type[Backend]:
    """The class of the backend called `name` (with `mtp`: the one that drafts with the target's MTP head); one-line
    error naming the choices otherwise."""
    known(name)
    module, _, cls = (MTP_CLASSES.get(name, BACKENDS[name]) if mtp else BACKENDS[name]).partition(":")
    return getattr(importlib.import_module(module), cls)


def levers(name: str):
    """The lever options of the backend called `name` (ADOPTED, LEVERS, parse_lever), None when it has none; reads
    no engine, so a command's --help may name them."""
    return importlib.import_module(LEVERS[name]) if name in LEVERS else None


def capabilities(name: str) -> Capabilities:
    """What the backend called `name` can do (its class's `caps`), read without importing the backend."""
    lv = levers(known(name))
    return replace(CAPS[name], levers=type(lv.ADOPTED)) if lv is not None else CAPS[name]


def check_for_backend(backend: str, split) -> None:
    """A backend that places nothing on GPUs takes no GPU split (an placement.GpuSplit): refuse one instead of
    ignoring it."""
    if split is not None and not split.default and not capabilities(backend).placement:
        raise OptionError("gpu_split" if split.gpu_split else "tensor_parallel" if split.tensor_parallel
                          else "draft_device", f"needs --backend {gpu_backend()} (got {split.tag})")


def gpu_backend() -> str:
    """The backend that runs on a GPU only (the app's and the Space's choice where there is one)."""
    return next(n for n in BACKENDS if capabilities(n).gpu_only)


def cpu_backend() -> str:
    """The backend that also runs on a CPU (the fallback)."""
    return next(n for n in BACKENDS if not capabilities(n).gpu_only)
