"""Multi-bitrate EXL3 conversion of DFlash drafters: validate, plan, calibrate, convert, check, report.

`quantize` loads on first use (PEP 562): the recipe and plan modules import without torch, so
`python -m toolkit.quantize --help` answers at once.
"""

__all__ = ["quantize"]


def __getattr__(name: str):
    if name == "quantize":
        from .pipeline import quantize

        return quantize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
