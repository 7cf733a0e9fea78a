"""Multi-bitrate EXL3 conversion of DFlash drafters: validate, plan, calibrate, convert, check, report.

`quantize` loads on first use (PEP 562): the recipe, plan and options modules import without torch, so
`python -m toolkit.quantize --help` answers at once. `quantize(QuantizeOptions(...))` runs the pipeline.
"""

from .options import QuantizeOptions

__all__ = ["QuantizeOptions", "quantize"]


def __getattr__(name: str):
    if name == "quantize":
        from .pipeline import quantize

        return quantize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
