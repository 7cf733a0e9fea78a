"""Multi-bitrate EXL3 conversion of DFlash drafters: validate, plan, calibrate, convert, check, report."""

from .pipeline import quantize

__all__ = ["quantize"]
