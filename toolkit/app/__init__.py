"""The Gradio app that shows DFlash speculative decoding next to plain AR (see docs/app.md).

ui builds the page, handlers streams a turn, render draws tokens and plots, models picks and loads the backend.
"""

from .models import Hardware, Loaded, ModelSpec, load
from .ui import build_app, launch_app, serve

__all__ = ["Hardware", "Loaded", "ModelSpec", "build_app", "launch_app", "load", "serve"]
