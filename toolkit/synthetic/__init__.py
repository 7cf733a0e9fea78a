"""Synthetic EXL3 checkpoints of a real model's exact shape, for performance work without the real weights.

`python -m toolkit.synth --config CONFIG_JSON --bits B --out DIR` (the command is toolkit/synth.py); `synth()` is the API.
"""

from .build import SynthInputs, synth
from .codebook import codebook_table, decode_linear
from .layout import Plan, TensorSpec, build_plan, kind_of

__all__ = ["Plan", "SynthInputs", "TensorSpec", "build_plan", "codebook_table", "decode_linear", "kind_of", "synth"]
