"""Hub refs: REPO@REVISION parsing, and fetch through the real huggingface_hub client against tests/hubserver.py.

Every Hub path is covered on loopback: a branch, a tag, a sha, main, a missing branch, a missing repo (404),
a server error (5xx), offline mode (with and without the snapshot cached) and a refused connection.
"""

from __future__ import annotations

import socket

import pytest
from huggingface_hub import HfApi, constants

from hubserver import Fault, HubServer
from toolkit.core.errors import ToolkitError
from toolkit.hub.push import hub_endpoint
from toolkit.core.refs import Ref, fetch, is_repo_id, parse_ref

TOKEN = "hf_refs_token_q7"
REPO = "alice/drafter-exl3"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with HubServer(tmp_path / "hub", tokens={TOKEN: "alice"}) as server:
        api = HfApi(endpoint=server.url, token=TOKEN)
        with hub_endpoint(server.url):
            api.create_repo(REPO)
            api.upload_file(path_or_fileobj=b"# main card\n", path_in_repo="README.md", repo_id=REPO)
            api.create_branch(REPO, branch="4.0bpw")
            api.upload_file(path_or_fileobj=b'{"bits": 4.0}', path_in_repo="config.json", repo_id=REPO,
                            revision="4.0bpw")
            api.upload_file(path_or_fileobj=b"\0" * 64, path_in_repo="model.safetensors", repo_id=REPO,
                            revision="4.0bpw")
            api.upload_file(path_or_fileobj=b"# 4.0bpw card\n", path_in_repo="README.md", repo_id=REPO,
                            revision="4.0bpw")
            api.create_tag(REPO, tag="v1", revision="4.0bpw")
        yield server


def get(hub, text: str, tmp_path, what: str = "target", endpoint: str | None = None):
    return fetch(text, what, endpoint=endpoint or hub.url, cache_dir=tmp_path / "cache")


def one_line_error(fn) -> str:
    with pytest.raises(ToolkitError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg and TOKEN not in msg
    return msg


def test_parse_ref_repo_revision_and_folders(tmp_path, monkeypatch):
    sha = "0123456789abcdef" * 2 + "01234567"
    assert parse_ref("alice/x") == Ref("alice/x", None)
    assert parse_ref("alice/x-exl3@4.0bpw") == Ref("alice/x-exl3", "4.0bpw")
    assert parse_ref(f"alice/x@{sha}") == Ref("alice/x", sha)
    assert parse_ref("alice/x@refs/pr/1").revision == "refs/pr/1"
    assert str(parse_ref("alice/x@4.0bpw")) == "alice/x@4.0bpw" and str(parse_ref("gpt2")) == "gpt2"
    folder = tmp_path / "model@4.0bpw"       # an existing folder is a folder, '@' or not
    folder.mkdir()
    assert parse_ref(str(folder)) == Ref(path=folder) and parse_ref(str(folder)).is_local
    monkeypatch.chdir(tmp_path)
    assert parse_ref("model@4.0bpw").is_local
    (tmp_path / "f.txt").write_text("x")
    for bad, msg in [("../..@main", "no such folder, and not a Hub repo id"), ("./nope/x", "no such folder"),
                     ("/no/such/place", "no such folder"), ("a/b/c", "no such folder"),
                     ("alice/x@", "nothing after '@'"), ("alice/x@..", "not a valid branch"),
                     ("alice/x@a b", "not a valid branch"), ("al--ice/x", "neither a folder"),
                     ("-alice/x", "neither a folder"), ("f.txt", "is a file"), ("", "empty model name")]:
        with pytest.raises(ToolkitError, match=msg) as err:
            parse_ref(bad, "target")
        assert str(err.value).startswith("--target: ") and "\n" not in str(err.value), bad
    assert not is_repo_id("../..") and not is_repo_id("a/..") and not is_repo_id("a/b.") and is_repo_id("a.b/c_d-e")


def test_fetch_by_branch_tag_sha_and_main(hub, tmp_path):
    branch_sha = hub.repos[REPO].branches["4.0bpw"]
    path, sha = get(hub, f"{REPO}@4.0bpw", tmp_path)
    assert sha == branch_sha and path.name == branch_sha
    assert (path / "config.json").read_bytes() == b'{"bits": 4.0}' and (path / "model.safetensors").stat().st_size == 64
    assert (path / "README.md").read_bytes() == b"# 4.0bpw card\n"       # the branch's own files, not main's
    assert get(hub, f"{REPO}@v1", tmp_path)[1] == branch_sha
    path, sha = get(hub, f"{REPO}@{branch_sha}", tmp_path)
    assert sha == branch_sha and (path / "config.json").is_file()
    path, sha = get(hub, REPO, tmp_path)
    assert sha == hub.repos[REPO].branches["main"] and (path / "README.md").read_bytes() == b"# main card\n"


def test_fetch_local_folder_has_no_sha(tmp_path):
    (tmp_path / "m").mkdir()
    assert fetch(str(tmp_path / "m"), "draft") == (tmp_path / "m", None)
    assert fetch(Ref(path=tmp_path / "m")) == (tmp_path / "m", None)
    with pytest.raises(ToolkitError, match="--draft: .*no such folder"):
        fetch(Ref(path=tmp_path / "gone"), "draft")


def test_missing_branch(hub, tmp_path):
    msg = one_line_error(lambda: get(hub, f"{REPO}@3.0bpw", tmp_path))
    assert msg.startswith("--target: ") and f"{REPO} has no branch, tag or commit '3.0bpw'" in msg


def test_missing_repo_is_404(hub, tmp_path):
    msg = one_line_error(lambda: get(hub, "alice/nope@4.0bpw", tmp_path, what="draft"))
    assert msg.startswith("--draft: ") and "repository alice/nope not found" in msg and "HTTP 404" in msg


def test_server_error(hub, tmp_path):
    hub.faults.append(Fault("info", times=1000, status=503))
    msg = one_line_error(lambda: get(hub, f"{REPO}@4.0bpw", tmp_path))
    assert "answered HTTP 503 (a server error)" in msg
    hub.faults.clear()
    assert get(hub, f"{REPO}@4.0bpw", tmp_path)[1] == hub.repos[REPO].branches["4.0bpw"]


def test_offline_mode(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    seen = len(hub.log)
    msg = one_line_error(lambda: get(hub, f"{REPO}@4.0bpw", tmp_path))
    assert "not in the local Hub cache and offline mode is on" in msg and len(hub.log) == seen   # no request sent


def test_offline_uses_the_cached_snapshot(hub, tmp_path, monkeypatch):
    online = get(hub, f"{REPO}@4.0bpw", tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    seen = len(hub.log)
    assert get(hub, f"{REPO}@4.0bpw", tmp_path) == online and len(hub.log) == seen


def test_connection_refused(hub, tmp_path):
    with socket.socket() as s:                   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    msg = one_line_error(lambda: get(hub, f"{REPO}@4.0bpw", tmp_path, endpoint=f"http://127.0.0.1:{port}"))
    assert f"cannot connect to http://127.0.0.1:{port}" in msg and "connection refused" in msg


def test_hf_endpoint_is_read_at_call_time(hub, tmp_path, monkeypatch):
    """huggingface_hub reads HF_ENDPOINT once, at import; fetch reads it when called, so setting it later works."""
    assert constants.ENDPOINT != hub.url
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    path, sha = fetch(f"{REPO}@4.0bpw", "target", cache_dir=tmp_path / "cache")
    assert sha == hub.repos[REPO].branches["4.0bpw"] and (path / "config.json").read_bytes() == b'{"bits": 4.0}'
    monkeypatch.delenv("HF_ENDPOINT")
    assert get(hub, f"{REPO}@v1", tmp_path)[1] == sha          # an explicit endpoint= needs no env var


def test_the_factory_fetches_hub_refs_and_keeps_paths(tmp_path, monkeypatch):
    """load_backend (generate, bench, eval_tau and the app build through it) takes USER/NAME@BRANCH, the EXL3
    quants' layout: the ref goes through core.refs.fetch (tested against the loopback Hub above); paths stay paths."""
    from toolkit.assets.pairs import tiny_pair
    from toolkit.runtime import factory

    t, d = tiny_pair()
    asked = []

    def fake_fetch(ref, what):
        asked.append((str(ref), what))
        return ({"target": t, "draft": d}[what], "0" * 40)

    monkeypatch.setattr(factory, "fetch", fake_fetch)
    be = factory.load_backend("torch", "alice/tiny@4.0bpw", "alice/tiny-dflash@4.0bpw")
    assert asked == [("alice/tiny@4.0bpw", "target"), ("alice/tiny-dflash@4.0bpw", "draft")] and be.block_size == 16
    asked.clear()
    factory.load_backend("torch", str(t), str(d))
    assert asked == []
    with pytest.raises(ToolkitError, match="--target: ./nope is not a folder"):
        factory.load_backend("torch", "./nope", str(d))
