"""The DFlash drafter: config, reference PyTorch module, checkpoint loading.

The torch parts (model.py, loading.py) load on first use (PEP 562), so `toolkit.dflash.config` imports without
torch: a drafter folder's config.json is read and checked before any heavy library loads.
"""

from .config import DFlashConfig

_LOADING = ("load_drafter", "read_tensors", "save_drafter")
_MODEL = ("DFlashDraft", "DraftCache", "gather_taps")
__all__ = sorted(("DFlashConfig",) + _LOADING + _MODEL)


def __getattr__(name: str):
    if name in _LOADING:
        from . import loading

        return getattr(loading, name)
    if name in _MODEL:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
