"""The app's embedded default: SmolLM2-135M-Instruct with the drafter trained for it, served on CPU, one chat round
through gradio_client; speculative text equals AR text and the drafter's tokens are accepted."""

from __future__ import annotations

import pytest

pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from toolkit.app.models import Hardware, ModelSpec, load  # noqa: E402
from toolkit.app.ui import build_app, serve  # noqa: E402
from toolkit.assets.smollm2 import DRAFT  # noqa: E402

OUT = ["chat", "box", "banner", "spec", "ar", "tau", "blocks", "acc", "hist", "message", "result"]


@pytest.mark.slow
def test_default_app_chats_with_smollm2(monkeypatch):
    assert (DRAFT / "config.json").is_file(), f"{DRAFT}: the shipped SmolLM2 drafter is missing"
    monkeypatch.setenv("DFLASH_DEMO", "smollm2")
    loaded = load(ModelSpec(), Hardware())
    assert loaded.error is None, loaded.error
    assert loaded.demo_kind == "smollm2" and loaded.backend_name == "torch", (loaded.demo_kind, loaded.notes)
    demo = serve(build_app(loaded), block=False)
    try:
        out = dict(zip(OUT, Client(demo.local_url, verbose=False).predict(
            "Write a Python function that returns the square of a number.", [], 16, 40, 0.0, 0, "", False, api_name="/chat")))
    finally:
        demo.close()
    res = out["result"]
    assert res["text"] and res["lossless"] and res["text"] == res["ar_text"], res
    assert res["tau"] > 1.0, res["tau"]                     # real accepted draft tokens, not a random drafter
