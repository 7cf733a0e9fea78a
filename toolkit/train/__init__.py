"""Drafter training pieces shared by `python -m toolkit.train_drafter` and the tiny pair's builder."""

from .objective import anchor_batch, anchor_forward, block_batch, block_loss, position_weights
from .optim import OptimState, optimize

__all__ = ["OptimState", "anchor_batch", "anchor_forward", "block_batch", "block_loss", "optimize", "position_weights"]
