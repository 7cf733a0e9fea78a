"""The DFlash drafter: config, reference PyTorch module, checkpoint loading."""

from .config import DFlashConfig
from .loading import load_drafter, read_tensors, save_drafter
from .model import DFlashDraft, DraftCache, gather_taps

__all__ = ["DFlashConfig", "DFlashDraft", "DraftCache", "gather_taps", "load_drafter", "read_tensors", "save_drafter"]
