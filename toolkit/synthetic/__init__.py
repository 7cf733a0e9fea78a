"""Synthetic EXL3 checkpoints of a real model's exact shape, for performance work without the real weights.

`python -m toolkit.synth --config CONFIG_JSON --bits B --out DIR` (the command is toolkit/synth.py); `synth()` is the API.
Its names load on first use (PEP 562), so `toolkit.synthetic.inputs` (the checks of synth's inputs) imports without torch.
"""

_NAMES = {"SynthInputs": "inputs", "synth": "build", "codebook_table": "codebook", "decode_linear": "codebook",
          "Plan": "layout", "TensorSpec": "layout", "build_plan": "layout", "kind_of": "layout"}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        from importlib import import_module

        return getattr(import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
