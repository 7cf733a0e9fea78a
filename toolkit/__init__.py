"""DFlash speculative decoding toolkit for ExLlamaV3: reference drafter, runtime, quantization, app."""

__version__ = "0.1.0"
