"""Drafter training pieces shared by `python -m toolkit.train_drafter` and the tiny pair's builder."""

from .objective import anchor_batch, anchor_forward, block_batch, chunked_loss, position_weights, sample_anchors
from .optim import OptimState, optimize

__all__ = ["OptimState", "anchor_batch", "anchor_forward", "block_batch", "chunked_loss", "optimize", "position_weights",
           "sample_anchors"]
