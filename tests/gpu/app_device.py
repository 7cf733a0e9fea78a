"""Device check for the app: its handler runs with the exllamav3 backend on fixtures, headless, via gradio_client.

    source .device/on-device.sh && python3 tests/gpu/app_device.py [--trained]

Builds a hidden-128 llama fixture pair (exllamav3 pads linears to 128; --trained trains the pair128 recipe on
the GPU for a drafter that accepts, under a minute; default: a random pair, seconds), loads it through the
app's own model choice with backend exllamav3, serves the page in-process (no browser), and drives /chat
through gradio_client: a greedy round at the native block, one at block 8, an empty prompt, and a queue of
two. Results go to $OUT/app_device.json; exit 1 when a check fails.

The device needs gradio and gradio_client as carried wheels (cp312): see the lead's device prep. gradio's
templates/node and media_assets can be dropped from its wheel to fit the carry (the API and page still work).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/dev_app")
REPORT: dict = {"checks": {}, "errors": {}}
T0 = time.time()
FIELDS = ["chat", "box", "banner", "spec", "ar", "tau", "blocks", "acc", "hist", "message", "result"]


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "app_device.json").write_text(json.dumps(REPORT, indent=2, default=str))


def check(name: str, fn, *a):
    log("begin", name)
    try:
        REPORT["checks"][name] = fn(*a)
        log("ok", name, json.dumps(REPORT["checks"][name], default=str)[:500])
    except Exception as e:          # record, go on
        REPORT["errors"][name] = "".join(traceback.format_exception(e))[-3000:]
        log("FAILED", name, repr(e)[:400])
    save()


def fixtures(trained: bool) -> tuple[str, str]:
    from toolkit.fixtures import build

    if trained:
        from pair128 import train_pair

        t, d, secs = train_pair(WORK / "pair128")
        REPORT["pair128_train_s"] = round(secs, 1)
        return str(t), str(d)
    t, d = build(WORK / "rand128", arch="llama", block_size=16, hidden=128)
    return str(t), str(d)


def chat(client, prompt: str, block: int, max_new: int = 48) -> dict:
    return dict(zip(FIELDS, client.predict(prompt, [], block, max_new, 0.0, 0, "", False, api_name="/chat")))


def main(trained: bool = False) -> int:
    import torch
    from gradio_client import Client

    from toolkit.app.models import Hardware, ModelSpec, load
    from toolkit.app.ui import build_app, serve

    REPORT["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    target, draft = fixtures(trained)
    hw = Hardware.detect()
    loaded = load(ModelSpec(target=target, draft=draft, backend="exllamav3"), hw)
    REPORT["load"] = {"backend": loaded.backend_name, "device": loaded.device, "error": loaded.error, "notes": loaded.notes,
                      "block_size": loaded.block_size, "max_context": loaded.max_context, "hardware": hw.label()}
    log("loaded", REPORT["load"])
    if loaded.error or loaded.backend_name != "exllamav3" or type(loaded.backend).__name__ == "TorchBackend":
        REPORT["errors"]["load"] = f"expected the exllamav3 backend, got {REPORT['load']}"
        save()
        return 1
    demo = serve(build_app(loaded), block=False)
    client = Client(demo.local_url, verbose=False)
    try:
        def greedy(block: int):
            out = chat(client, "Return the", block)
            r = out["result"]
            assert r["lossless"] and r["text"] == r["ar_text"] and r["tokens"], "speculative != AR under greedy"
            assert "×" in out["banner"] and 'class="tok ' in out["spec"], "banner or coloured tokens missing"
            assert max(len(x["drafted"]) for x in r["rounds"]) <= block - 1
            return {k: r[k] for k in ("tau", "tok_s", "ar_tok_s", "speedup", "lossless", "block_size")} | {
                "tokens": len(r["tokens"]), "rounds": len(r["rounds"]), "text": r["text"][:120]}

        check("chat_native_block", greedy, loaded.block_size)
        check("chat_block_8", greedy, 8)

        def empty():
            out = chat(client, "   ", loaded.block_size)
            assert "prompt is empty" in out["message"], out["message"]
            return {"message": out["message"][:200]}

        check("empty_prompt_message", empty)

        def queue_of_two():
            a = Client(demo.local_url, verbose=False).submit("Return the", [], 16, 96, 0.0, 0, "", False, api_name="/chat")
            b = Client(demo.local_url, verbose=False).submit("Create a new", [], 16, 16, 0.0, 0, "", False, api_name="/chat")
            ra, rb = dict(zip(FIELDS, a.result()))["result"], dict(zip(FIELDS, b.result()))["result"]
            assert ra["lossless"] and rb["lossless"]
            return {"a_tok_s": ra["tok_s"], "b_tok_s": rb["tok_s"]}

        check("queue_of_two", queue_of_two)
    finally:
        demo.close()
    REPORT["seconds"] = round(time.time() - T0, 1)
    save()
    log("done", "errors:", list(REPORT["errors"]))
    return 1 if REPORT["errors"] else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trained", action="store_true", help="train the hidden-128 pair on the GPU (accepting drafter)")
    sys.exit(main(**vars(ap.parse_args())))
