"""A target's own multi-token-prediction (MTP) head as the drafter (`--draft mtp`): which targets carry one and its
shape (config.py, no torch), and its PyTorch reference (head.py, imported where it runs)."""

from .config import DEPTH, MTP, MtpShape, hf_tensors, is_mtp, read_mtp

__all__ = ["DEPTH", "MTP", "MtpShape", "hf_tensors", "is_mtp", "read_mtp"]
