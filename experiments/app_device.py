"""Device check for the app: its handler runs with the exllamav3 backend on fixtures, headless, via gradio_client.

    source .device/on-device.sh && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/app/*.whl && python -m experiments.app_device [--trained]

(one line on the device, carry [".device", ".whl/app"]; on-device.sh already puts /tmp/site on PYTHONPATH.)
With --demo TARGET it serves the app's own SmolLM2 demo instead (the target staged by `smol_device stage`, padded
for exllamav3 by the app, as a GPU Space runs it) and records the ratio each answer shows at the page's defaults.
Otherwise it builds a hidden-128 llama fixture pair (exllamav3 pads linears to 128; --trained trains the pair128 recipe on
the GPU for a drafter that accepts, under a minute; default: a random pair, seconds), loads it through the
app's own model choice with backend exllamav3, serves the page in-process (no browser), and drives /chat
through gradio_client: a greedy round at the native block, one at block 8, a second turn that must carry the
first (the whole conversation is encoded), an empty prompt, and a queue of two. Results go to
$OUT/app_device.json; exit 1 when a check fails.

The device has no network and lacks gradio: `python -m experiments.app_device --build-wheels .whl/app` (here, with
PyPI) downloads the cp312 manylinux wheels of gradio 6.31.0, gradio_client 2.7.2 and the dependencies the device
does not have (WHEELS), and slims gradio's wheel (SLIM: the SSR node server, the ffmpeg.wasm of the browser's
audio/video tools, the media and test assets; the API and the page still work), about 11 MiB in all.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from experiments.harness import Run, device_name, download_wheels

# what the device lacks of gradio 6.31.0's and gradio_client 2.7.2's Requires-Dist, recursively (it has numpy, pandas,
# pillow, httpx, huggingface-hub, jinja2, pydantic, typer, rich, pyyaml, anyio, click, h11, ... already)
WHEELS = ["gradio==6.31.0", "gradio_client==2.7.2", "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.55.0",
          "python-multipart==0.0.34", "orjson==3.13.0", "brotli==1.2.1", "groovy==0.1.2", "hf-gradio==0.4.1",
          "safehttpx==0.1.7", "semantic-version==2.10.0", "tomlkit==0.14.0", "pydub==0.25.1", "pytz==2026.6",
          "annotated-doc==0.0.7", "opentelemetry-api==1.45.2"]
SLIM = ("gradio/templates/node/", "gradio/templates/frontend/static/ffmpeg/", "gradio/media_assets/", "gradio/test_data/",
        "gradio/CHANGELOG.md")
WORK = Path("/tmp/dev_app")
FIELDS = ["chat", "box", "banner", "spec", "ar", "tau", "blocks", "acc", "hist", "message", "result"]


def fixtures(run: Run, trained: bool) -> tuple[str, str]:
    from toolkit.assets.fixtures import build

    if trained:
        from experiments.pair128 import train_pair

        t, d, secs = train_pair(WORK / "pair128")
        run.results["pair128_train_s"] = round(secs, 1)
        return str(t), str(d)
    t, d = build(WORK / "rand128", arch="llama", block_size=16, hidden=128)
    return str(t), str(d)


def chat(client, prompt: str, block: int, max_new: int = 48) -> dict:
    return dict(zip(FIELDS, client.predict(prompt, [], block, max_new, 0.0, 0, "", False, api_name="/chat")))


def slim_wheel(src: Path, dst: Path, drop=SLIM) -> tuple[int, int]:
    """Copy a wheel without the members under `drop` (and their RECORD lines); the rest stays byte-identical."""
    dropped = lambda name: any(name == d or name.startswith(d) for d in drop)  # noqa: E731
    n = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                n += 1
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(ln for ln in lines if not dropped(ln.split(",", 1)[0])) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return n, dst.stat().st_size


def build_wheels(dest: Path) -> int:
    """Here, with PyPI: the app's cp312 wheels for the device into `dest`, gradio's slimmed."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for w in download_wheels(Path(tmp), WHEELS):
            if w.name.startswith("gradio-"):
                n, size = slim_wheel(w, dest / w.name)
                print(f"{w.name}: {w.stat().st_size / 2**20:.1f} MiB -> {size / 2**20:.1f} MiB ({n} files dropped)")
            else:
                (dest / w.name).write_bytes(w.read_bytes())
    total = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
    return 0


def check_app(run: Run, loaded, url: str) -> None:
    """The five chat checks against the page served at `url`, each a step of the run."""
    from gradio_client import Client

    client = Client(url, verbose=False)

    def greedy(block: int):
        out = chat(client, "Return the", block)
        r = out["result"]
        assert r["lossless"] and r["text"] == r["ar_text"] and r["tokens"], "speculative != AR under greedy"
        assert "×" in out["banner"] and 'class="tok ' in out["spec"], "banner or coloured tokens missing"
        assert max(len(x["drafted"]) for x in r["rounds"]) <= block - 1
        return {k: r[k] for k in ("tau", "tok_s", "ar_tok_s", "speedup", "lossless", "block_size")} | {
            "tokens": len(r["tokens"]), "rounds": len(r["rounds"]), "text": r["text"][:120]}

    run.step("chat_native_block", greedy, loaded.block_size)
    run.step("chat_block_8", greedy, 8)

    def two_turns():
        be, seen = loaded.backend, []
        generate = be.generate

        def recording(ids, settings, speculative=True):
            seen.append(list(ids))
            return generate(ids, settings, speculative)

        be.generate = recording
        try:
            first = chat(client, "Return the", loaded.block_size, 24)
            second = dict(zip(FIELDS, client.predict("Create a new", first["chat"], loaded.block_size, 24, 0.0, 0, "",
                                                     False, api_name="/chat")))
        finally:
            del be.generate
        ids1, ar1, ids2, ar2 = seen
        r = second["result"]
        assert ids1 == ar1 and ids2 == ar2, "speculative and AR runs got different prompts"
        text = be.tokenizer.decode(ids2)
        assert len(ids2) > len(ids1) and "Return the" in text and "Create a new" in text, "turn 2 lacks turn 1"
        assert r["lossless"] and r["text"] == r["ar_text"] and r["tokens"], "speculative != AR on the second turn"
        return {"prompt_1": len(ids1), "prompt_2": len(ids2), "prefix": ids2[: len(ids1)] == ids1, "tau": r["tau"],
                "template": bool(getattr(be.tokenizer, "chat_template", None)), "text": r["text"][:120]}

    run.step("second_turn_carries_the_first", two_turns)

    def empty():
        out = chat(client, "   ", loaded.block_size)
        assert "prompt is empty" in out["message"], out["message"]
        return {"message": out["message"][:200]}

    run.step("empty_prompt_message", empty)

    def queue_of_two():
        a = Client(url, verbose=False).submit("Return the", [], 16, 96, 0.0, 0, "", False, api_name="/chat")
        b = Client(url, verbose=False).submit("Create a new", [], 16, 16, 0.0, 0, "", False, api_name="/chat")
        ra, rb = dict(zip(FIELDS, a.result()))["result"], dict(zip(FIELDS, b.result()))["result"]
        assert ra["lossless"] and rb["lossless"]
        return {"a_tok_s": ra["tok_s"], "b_tok_s": rb["tok_s"]}

    run.step("queue_of_two", queue_of_two)


DEMO_PROMPTS = ["Explain speculative decoding to a ten-year-old in three sentences.",
                "Write a Python function that checks whether a string is a palindrome.",
                "List five facts about the Moon.", "Write a short email asking a colleague to review a pull request."]


def round_profile(rounds: list[dict]) -> dict:
    """A turn's decode rounds by verify width (0 = AR): how many, and their median ms (draft + verify)."""
    import statistics

    by: dict[int, list[float]] = {}
    for r in rounds:
        if not r["prefill"]:
            by.setdefault(len(r["drafted"]), []).append(r["t_draft_ms"] + r["t_verify_ms"])
    return {str(w): [len(ms), round(statistics.median(ms), 2)] for w, ms in sorted(by.items())}


def run_demo(run: Run, smol_target: Path, turns: int) -> int:
    """The app's own SmolLM2 demo as a GPU Space serves it (the staged target, padded for exllamav3 by the app), driven
    through gradio_client at the page's defaults (block auto, greedy): the ratio each answer shows, lossless."""
    cache = Path(tempfile.mkdtemp(prefix="app-demo-")) / "dflash-toolkit"
    cache.mkdir(parents=True)
    (cache / smol_target.name).symlink_to(smol_target)        # prepared by `smol_device stage`: found, not converted
    os.environ["XDG_CACHE_HOME"] = str(cache.parent)
    os.environ["DFLASH_DEMO"] = "smollm2"
    from gradio_client import Client

    from toolkit.app.models import Hardware, ModelSpec, load
    from toolkit.app.ui import build_app, serve

    run.results["device"] = device_name()
    hw = Hardware.detect()
    loaded = run.step("load_demo", lambda: load(ModelSpec(), hw), keep=False)
    if loaded is None:
        return run.finish()
    run.results["load"] = {"backend": loaded.backend_name, "demo": loaded.demo_kind, "error": loaded.error,
                           "notes": loaded.notes, "block_size": loaded.block_size, "hardware": hw.label()}
    if loaded.error or loaded.backend_name != "exllamav3" or loaded.demo_kind != "smollm2":
        run.errors["load"] = f"expected the SmolLM2 demo on exllamav3, got {run.results['load']}"
        return run.finish()
    demo = serve(build_app(loaded), block=False)
    try:
        client = Client(demo.local_url, verbose=False)
        chat(client, "Hello", "auto", 8)                                   # the first turn times the costs

        def turn(prompt: str) -> dict:
            out = chat(client, prompt, "auto", 128)
            r = out["result"]
            assert r["lossless"] and r["text"] == r["ar_text"], "speculative != AR under greedy"
            return {k: r.get(k) for k in ("tau", "tok_s", "ar_tok_s", "speedup", "speedup_reason")} | {
                "tokens": len(r["tokens"]), "banner": out["banner"][:300], "rounds": round_profile(r["rounds"])}

        shown = [run.step(f"turn_{i + 1}", turn, DEMO_PROMPTS[i % len(DEMO_PROMPTS)]) for i in range(turns)]
        run.results["shown_speedups"] = [t["speedup"] for t in shown if t]
    finally:
        demo.close()
    return run.finish()


def run_checks(run: Run, trained: bool) -> int:
    from toolkit.app.models import Hardware, ModelSpec, load
    from toolkit.app.ui import build_app, serve

    run.results["device"] = device_name()
    target, draft = fixtures(run, trained)
    hw = Hardware.detect()
    loaded = load(ModelSpec(target=target, draft=draft, backend="exllamav3"), hw)
    run.results["load"] = {"backend": loaded.backend_name, "device": loaded.device, "error": loaded.error, "notes": loaded.notes,
                           "block_size": loaded.block_size, "max_context": loaded.max_context, "hardware": hw.label()}
    run.log("loaded", run.results["load"])
    if loaded.error or loaded.backend_name != "exllamav3" or type(loaded.backend).__name__ == "TorchBackend":
        run.errors["load"] = f"expected the exllamav3 backend, got {run.results['load']}"
        return run.finish()
    demo = serve(build_app(loaded), block=False)
    try:
        check_app(run, loaded, demo.local_url)
    finally:
        demo.close()
    return run.finish()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.app_device", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trained", action="store_true", help="train the hidden-128 pair on the GPU (accepting drafter)")
    ap.add_argument("--build-wheels", type=Path, metavar="DIR", help="here, not on the device: download and slim the wheels")
    ap.add_argument("--demo", type=Path, metavar="TARGET", help="serve the app's SmolLM2 demo from this staged target "
                    "(smol_device stage: /tmp/smol-run/smollm2-135m-instruct) and record the ratio each answer shows")
    ap.add_argument("--turns", type=int, default=6, help="answers in --demo mode (default 6)")
    args = ap.parse_args(argv)
    if args.build_wheels:
        return build_wheels(args.build_wheels)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run = Run("app_device.json", section="checks")
    try:
        return run_demo(run, args.demo, args.turns) if args.demo else run_checks(run, args.trained)
    except Exception as e:      # an import or serve failure: still leave the report
        run.fail("main", e)
        raise


if __name__ == "__main__":
    sys.exit(main())
