"""The app loads `--target USER/X-exl3@4.0bpw` from the loopback Hub (tests/hubserver.py) with the real
huggingface_hub client: the branch's folder, not main's, is what runs, and the page names the branch and the
commit it resolved to. A missing branch is one line in the page. Only 127.0.0.1 is reachable here.

The branch holds the tiny pair's target; main holds the same target with a hidden_size the drafter does not
fit, so loading main fails and only loading the branch can succeed. The torch backend runs it for real.
"""

from __future__ import annotations

import html
import importlib.util
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi, constants

sys.path.insert(0, str(Path(__file__).parent))
from hubserver import HubServer  # noqa: E402

from toolkit.app.handlers import ChatHandler  # noqa: E402
from toolkit.app.models import Hardware, ModelSpec, load  # noqa: E402
from toolkit.app.ui import header_html  # noqa: E402
from toolkit.assets.pairs import tiny_pair  # noqa: E402
from toolkit.hub.push import hub_endpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_app_hub_token_k3"
TARGET, DRAFT = "alice/tiny-exl3", "alice/tiny-dflash"


@pytest.fixture
def no_network(monkeypatch):
    """Any connection to a host other than 127.0.0.1 fails at once (the real Hub is never asked)."""
    real = socket.socket.connect
    tried = []

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            tried.append(address)
            raise ConnectionRefusedError(f"test: no network ({address[0]})")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return tried


@pytest.fixture
def hub(tmp_path, monkeypatch, no_network):
    """The loopback Hub with TARGET (main: a mismatched target; 4.0bpw: the tiny target) and DRAFT (main).
    HF_ENDPOINT is set after huggingface_hub's import: core.refs reads it at call time; the cache is a temp dir."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    target, draft = tiny_pair()
    wrong = tmp_path / "wrong-target"
    shutil.copytree(target, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with HubServer(tmp_path / "hub", tokens={TOKEN: "alice"}) as server:
        api = HfApi(endpoint=server.url, token=TOKEN)
        with hub_endpoint(server.url):
            api.create_repo(TARGET)
            api.upload_folder(folder_path=wrong, repo_id=TARGET)
            api.create_branch(TARGET, branch="4.0bpw")
            api.upload_folder(folder_path=target, repo_id=TARGET, revision="4.0bpw")
            api.create_repo(DRAFT)
            api.upload_folder(folder_path=draft, repo_id=DRAFT)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server
    assert not no_network, f"a request left the machine: {no_network}"


def app_module(folder: Path, space_json: dict | None = None):
    """app.py as a Space runs it: copied into `folder` (with space.json next to it when given) and imported."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "app.py", folder / "app.py")
    if space_json is not None:
        (folder / "space.json").write_text(json.dumps(space_json))
    spec = importlib.util.spec_from_file_location("dflash_app_under_test", folder / "app.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def serve_nothing(monkeypatch) -> list:
    """Replace the gradio launch by a list that receives the built page (the models load for real)."""
    from toolkit.app import ui

    pages = []
    monkeypatch.setattr(ui, "serve", lambda demo, *a, **k: pages.append(demo) or demo)
    return pages


OUT = ["chat", "box", "banner", "spec", "ar", "tau", "blocks", "acc", "hist", "message", "result"]


def one_turn(loaded, prompt: str = "json.dumps") -> dict:
    """The last update of one chat turn through the page's handler, by output name."""
    return dict(zip(OUT, list(ChatHandler(loaded).respond(prompt, [], 16, 24, 0.0, 0, "", False))[-1]))


@pytest.mark.parametrize("how", ["flag", "space.json"])
def test_app_loads_the_quant_branch_from_the_hub(hub, tmp_path, monkeypatch, capsys, how):
    branch, main = hub.repos[TARGET].branches["4.0bpw"], hub.repos[TARGET].branches["main"]
    pages = serve_nothing(monkeypatch)
    monkeypatch.delenv("DFLASH_TARGET", raising=False)
    monkeypatch.delenv("DFLASH_DRAFT", raising=False)
    if how == "flag":
        app_module(tmp_path / "app").main(["--target", f"{TARGET}@4.0bpw", "--draft", DRAFT])
    else:
        app_module(tmp_path / "space", {"target": f"{TARGET}@4.0bpw", "draft": DRAFT, "backend": "auto"}).main([])
    loaded = pages[0].handler.loaded
    assert loaded.error is None and loaded.backend is not None and loaded.backend_name == "torch", loaded.error
    assert loaded.target == f"{TARGET}@4.0bpw (commit {branch[:12]})"
    assert loaded.draft == f"{DRAFT}@main (commit {hub.repos[DRAFT].branches['main'][:12]})"
    assert f"target <code>{TARGET}@4.0bpw (commit {branch[:12]})</code>" in header_html(loaded)
    assert f"[app] target {TARGET}@4.0bpw (commit {branch[:12]}): " in capsys.readouterr().err   # and the console
    snaps = tmp_path / "hf-cache" / f"models--{TARGET.replace('/', '--')}" / "snapshots"
    assert [p.name for p in snaps.iterdir()] == [branch] and main != branch        # main was never downloaded
    assert any(f"/resolve/{branch}/model.safetensors" in p for _, p, _ in hub.log)
    res = one_turn(loaded)["result"]
    assert res["text"] and res["text"] == res["ar_text"], res                        # greedy: lossless


def test_main_of_the_same_repo_is_a_different_model(hub):
    """Without @4.0bpw the app gets main (the mismatched target): the revision is what picked the folder above."""
    got = load(ModelSpec(target=TARGET, draft=DRAFT), Hardware())
    assert got.backend is None and "hidden_size: drafter has 128, target has 32" in got.error


def test_missing_branch_is_one_line_in_the_page(hub, capsys, caplog):
    got = load(ModelSpec(target=f"{TARGET}@3.0bpw", draft=DRAFT), Hardware())
    assert got.backend is None and "\n" not in got.error
    assert got.error == (f"Could not load the models: target: {TARGET}@3.0bpw: {TARGET} has no branch, tag or "
                         f"commit '3.0bpw' on {hub.url}")
    assert got.error in html.unescape(one_turn(got, "hi")["message"])
    seen = capsys.readouterr()
    assert "Traceback" not in seen.out + seen.err + caplog.text


def test_missing_drafter_repo_names_the_drafter(hub):
    got = load(ModelSpec(target=f"{TARGET}@4.0bpw", draft="alice/no-such-dflash"), Hardware())
    assert got.backend is None and got.error.startswith("Could not load the models: draft: alice/no-such-dflash: ")
    assert "repository alice/no-such-dflash not found" in got.error and "\n" not in got.error
