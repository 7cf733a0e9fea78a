"""Drafter training pieces shared by `python -m toolkit.train_drafter` and the tiny pair's builder.

Its names load on first use (PEP 562), so `toolkit.train.config` (the command's options) imports without torch.
"""

_OBJECTIVE = ("anchor_batch", "anchor_forward", "block_batch", "chunked_loss", "position_weights", "sample_anchors")
_OPTIM = ("OptimState", "optimize")

__all__ = sorted(_OBJECTIVE + _OPTIM)


def __getattr__(name: str):
    if name in _OBJECTIVE:
        from . import objective

        return getattr(objective, name)
    if name in _OPTIM:
        from . import optim

        return getattr(optim, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
