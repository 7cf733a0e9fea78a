"""Publishing: the real huggingface_hub client against tests/hubserver.py on loopback. No test reaches the Hub."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import HfApi, ModelCard, constants, snapshot_download
from safetensors.numpy import save_file

from broken_server import broken_server
from hubserver import Fault, HubServer
from test_card import parse_table, sample_report
from toolkit.hub.card import render_card
from toolkit.core.errors import ToolkitError
from toolkit.hub.push import PushOptions, hub_endpoint, push

TOKEN = "hf_testtoken_a1b2c3d4e5f6"  # alice, a distinctive string we look for in every output
BOB = "hf_bobtoken_zz9"
REPO = "alice/drafter-exl3"
ROOT = Path(__file__).resolve().parents[2]


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0\xff\0\0")) + chunk(b"IEND", b"")


def write_out_dir(out: Path, seed: int = 0) -> dict:
    """A quantize OUT_DIR: report.json/.md, the plot, one folder per result with config, weights, card, stamp."""
    report = sample_report(seed)
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    for r in report["results"]:
        d = out / r["folder"]
        d.mkdir()
        cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "block_size": 16,
               "quantization_config": {"quant_method": "exl3", "version": "1.6.5", "bits": r["bits"],
                                       "head_bits": 6, "calibrated": r["calibrated"]}}
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({"layers.0.mlp.down_proj.trellis": rng.integers(0, 2**15, (16, 64), dtype=np.int16),
                   "norm.weight": rng.standard_normal(64).astype(np.float16)}, str(d / "model.safetensors"))
        (d / "README.md").write_text(render_card(report, bits=r["bits"]))
        (d / ".quantize.json").write_text(json.dumps({"bits": r["bits"]}))
        r["size_bytes"] = sum(p.stat().st_size for p in d.iterdir())
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text("# report\n")
    (out / "tau_top1.png").write_bytes(tiny_png())
    return report


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest sets offline for the model tests
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with HubServer(tmp_path / "hub", tokens={TOKEN: "alice", BOB: "bob"}) as server:
        yield server


@pytest.fixture
def out(tmp_path):
    write_out_dir(tmp_path / "out")
    return tmp_path / "out"


def do_push(hub, out, **kw):
    return push(PushOptions(repo=kw.pop("repo", REPO), out_dir=out, endpoint=hub.url, retry_delay=0.01, **kw))


def download(hub, tmp_path, revision: str, token=TOKEN) -> Path:
    return Path(snapshot_download(REPO, revision=revision, endpoint=hub.url, token=token,
                                  cache_dir=tmp_path / "cache", local_dir=tmp_path / "dl" / revision))


def test_round_trip_byte_for_byte(hub, out, tmp_path):
    result = do_push(hub, out)
    assert result.status == {"4.0bpw": "uploaded", "3.0bpw": "uploaded", "main": "uploaded"}
    refs = {b.name for b in HfApi(endpoint=hub.url, token=TOKEN).list_repo_refs(REPO).branches}
    assert refs == {"main", "4.0bpw", "3.0bpw"}  # the -uncal comparison folder gets no branch
    assert hub.commits(REPO) == 3
    report = json.loads((out / "report.json").read_text())
    for branch, bits in (("4.0bpw", 4.0), ("3.0bpw", 3.0)):
        got = download(hub, tmp_path, branch)
        files = {p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file() and ".cache" not in p.parts}
        assert files == {".gitattributes", "config.json", "model.safetensors", "README.md"}  # no .quantize.json
        for name in ("config.json", "model.safetensors"):
            assert (got / name).read_bytes() == (out / branch / name).read_bytes()
        assert (got / "README.md").read_text() == render_card(report, REPO, bits=bits,
                                                              branches={"4.0bpw": "4.0bpw", "3.0bpw": "3.0bpw"})
    main = download(hub, tmp_path, "main")
    for name in ("report.json", "report.md", "tau_top1.png"):
        assert (main / name).read_bytes() == (out / name).read_bytes()
    card = ModelCard.load(main / "README.md")
    assert card.data.base_model == report["model"] and card.data.library_name == "exllamav3"
    assert len(parse_table(card.text)) == len(report["results"]) + 1
    assert "![τ and top-1 agreement per block position](tau_top1.png)" in card.text


def test_rerun_is_idempotent_and_only_commits_changes(hub, out):
    do_push(hub, out)
    assert hub.commits(REPO) == 3
    again = do_push(hub, out)
    assert set(again.status.values()) == {"unchanged"} and hub.commits(REPO) == 3
    (out / "3.0bpw" / "config.json").write_text('{"changed": true}')
    third = do_push(hub, out)
    assert third.status == {"4.0bpw": "unchanged", "3.0bpw": "uploaded", "main": "unchanged"}
    assert hub.commits(REPO) == 4 and hub.commit_log[-1][1] == "3.0bpw"
    assert "config.json" in hub.commit_log[-1][2]  # 2.x sends only the changed file, 1.x the whole folder
    assert hub.files(REPO, "3.0bpw")["config.json"] == b'{"changed": true}'


def test_branch_mirrors_its_folder_and_missing_folders_are_skipped(hub, out):
    do_push(hub, out)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    with hub_endpoint(hub.url):  # huggingface_hub 1.x parses commit URLs against the default endpoint
        api.upload_file(path_or_fileobj=b"old", path_in_repo="model-old.safetensors", repo_id=REPO, revision="4.0bpw")
        api.upload_file(path_or_fileobj=b"mine", path_in_repo="notes.txt", repo_id=REPO)
    assert "model-old.safetensors" in hub.files(REPO, "4.0bpw")
    shutil.rmtree(out / "3.0bpw")
    result = do_push(hub, out)
    assert result.status == {"4.0bpw": "uploaded", "main": "uploaded"}  # main: the card now says 3.0 is absent
    assert set(hub.files(REPO, "4.0bpw")) == {".gitattributes", "config.json", "model.safetensors", "README.md"}
    main = hub.files(REPO, "main")
    assert "notes.txt" in main  # main is not mirrored: files a user added there stay
    rows = parse_table(main["README.md"].decode())
    assert [r["Branch"].endswith("(not uploaded)") for r in rows[:-1]] == [False, True, True]


def test_503_on_second_commit_is_retried(hub, out, capsys):
    hub.faults.append(Fault("commit", nth=2, status=503))
    result = do_push(hub, out)
    assert set(result.status.values()) == {"uploaded"}
    assert [s for m, p, s in hub.log if "/commit/" in p] == [200, 503, 200, 200]
    assert hub.commits(REPO) == 3 and "3.0bpw: HTTP 503; retrying" in capsys.readouterr().err


@pytest.mark.parametrize("after", [False, True], ids=["before-commit", "after-commit"])
def test_dropped_connection_is_retried_without_duplicates(hub, out, after):
    # after=True: the server commits, then hangs up; the retry must see the files there and not commit again
    hub.faults.append(Fault("commit", nth=1, drop=True, after=after))
    result = do_push(hub, out)
    assert result.status["4.0bpw"] == ("unchanged" if after else "uploaded")
    assert hub.commits(REPO) == 3 and hub.commits(REPO, "4.0bpw") == 1


def test_persistent_failure_names_branches_then_rerun_finishes(hub, out):
    hub.faults.append(Fault("commit", nth=2, times=1000, status=502))
    with pytest.raises(ToolkitError) as err:
        do_push(hub, out, retries=2)
    msg = str(err.value)
    assert "after 3 attempt(s) (HTTP 502)" in msg and "uploaded: 4.0bpw; not uploaded: 3.0bpw, main" in msg
    assert "\n" not in msg and hub.commits(REPO) == 1
    hub.faults.clear()
    result = do_push(hub, out)
    assert result.status == {"4.0bpw": "unchanged", "3.0bpw": "uploaded", "main": "uploaded"}
    assert hub.commits(REPO) == 3 and hub.commits(REPO, "4.0bpw") == 1


def test_repo_of_someone_else_is_a_permission_error(hub, out):
    HfApi(endpoint=hub.url, token=BOB).create_repo("bob/drafter-exl3")
    with pytest.raises(ToolkitError, match=r"permission denied .*user 'alice' cannot write to bob/drafter-exl3"):
        do_push(hub, out, repo="bob/drafter-exl3")
    with pytest.raises(ToolkitError, match="permission denied while creating carol/new"):
        do_push(hub, out, repo="carol/new")
    assert hub.commits("bob/drafter-exl3") == 0


def test_private_repo(hub, out, tmp_path):
    do_push(hub, out, private=True)
    assert hub.repos[REPO].private
    with pytest.raises(Exception):
        download(hub, tmp_path, "4.0bpw", token=BOB)


def test_dry_run_touches_nothing(hub, out, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    result = do_push(hub, out, dry_run=True)
    assert hub.log == [] and set(result.status.values()) == {"planned"}
    text = capsys.readouterr().out
    for line in ("4.0bpw  (3 files", "3.0bpw  (3 files", "main  (4 files", "model.safetensors", "tau_top1.png"):
        assert line in text
    assert "4.0bpw-uncal" not in text and ".quantize.json" not in text


def test_branch_template(hub, out):
    result = do_push(hub, out, branch_template="exl3-{bits:.2f}")
    assert set(result.status) == {"exl3-4.00", "exl3-3.00", "main"}
    with pytest.raises(ToolkitError, match="--branch-template"):
        do_push(hub, out, branch_template="{bogus}")
    with pytest.raises(ToolkitError, match="both map to"):
        do_push(hub, out, branch_template="same")


def run_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", **env}
    return subprocess.run([sys.executable, "-m", "toolkit.push", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_token_never_appears(hub, out, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    hub.faults.append(Fault("commit", nth=1, times=1000, status=500))
    with pytest.raises(ToolkitError) as err:
        do_push(hub, out, retries=1)
    assert TOKEN not in str(err.value) and TOKEN not in repr(err.value) and TOKEN not in caplog.text
    hub.faults.clear()
    home = {"HF_HOME": str(tmp_path / "home")}
    ok = run_cli(["--repo", REPO, "--from", str(out), "--endpoint", hub.url], {"HF_TOKEN": TOKEN, **home})
    assert ok.returncode == 0, ok.stderr
    bad = run_cli(["--repo", REPO, "--from", str(out), "--endpoint", hub.url], {"HF_TOKEN": TOKEN + "x", **home})
    assert bad.returncode == 2 and "the Hub rejected the token" in bad.stderr
    for proc in (ok, bad):
        assert TOKEN not in proc.stdout + proc.stderr


def test_cli_errors_are_one_line(hub, out, tmp_path):
    env = {"HF_HOME": str(tmp_path / "empty-home"), "HF_TOKEN": ""}
    proc = run_cli(["--repo", REPO, "--from", str(out), "--endpoint", hub.url], env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: no Hugging Face token: set HF_TOKEN or run `hf auth login` with a write token"]
    proc = run_cli(["--repo", "no-slash", "--from", str(out)], env)
    assert proc.returncode == 2 and "--repo must be USER/NAME" in proc.stderr
    proc = run_cli(["--repo", REPO, "--from", str(tmp_path)], env)
    assert proc.returncode == 2 and "has no report.json" in proc.stderr
    assert "--branch-template" in run_cli(["--help"], env).stdout


def test_quantize_push_download_round_trip(hub, tmp_path, pair, monkeypatch):
    """python -m toolkit.quantize ... --push REPO on the tiny pair (only the exllamav3 subprocess faked)."""
    import test_quantize_fakes as quantize_fakes
    from test_quantize_pipeline import write_recipe
    from toolkit.quantize import main

    quantize_fakes.install(monkeypatch)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # what HF_ENDPOINT=... does for a real mirror
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    target, draft = pair
    out = tmp_path / "q"
    assert main(["--recipe", str(write_recipe(tmp_path / "r.toml", target)), "--model", str(draft), "--out", str(out),
                 "--device", "cpu", "--bits", "2,8", "--also-uncalibrated", "--push", REPO]) == 0
    report = json.loads((out / "report.json").read_text())
    refs = {b.name for b in HfApi(endpoint=hub.url, token=TOKEN).list_repo_refs(REPO).branches}
    assert refs == {"main", "2.0bpw", "8.0bpw"} and hub.commits(REPO) == 3
    got = download(hub, tmp_path, "8.0bpw")
    for p in (out / "8.0bpw").rglob("*"):
        rel = p.relative_to(out / "8.0bpw").as_posix()
        if p.is_file() and not rel.startswith(".") and rel != "README.md":
            assert (got / rel).read_bytes() == p.read_bytes(), rel
    card = ModelCard.load(download(hub, tmp_path, "main") / "README.md")
    assert card.data.base_model == report["model"] == "test/tiny-dflash"
    rows = parse_table(card.text)
    assert [r["Branch"].split("]")[0].strip("[") for r in rows[:-1]] == [
        r["folder"] if r["calibrated"] else f"{r['folder']} (not uploaded)" for r in report["results"]]
    for row, r in zip(rows, report["results"]):
        assert abs(float(row["Top-1 agreement"].rstrip("%")) - 100 * r["top1"]) <= 0.05
        assert abs(float(row["τ (tokens/round)"]) - r["tau"]) <= 0.005


# --- what push refuses before it uploads anything, and how it names a failure ------------------------------------

def test_report_paths_must_stay_inside_from(hub, out, tmp_path):
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "id_rsa").write_text("private")
    report = json.loads((out / "report.json").read_text())
    report["results"][0]["folder"] = "../secret"
    (out / "report.json").write_text(json.dumps(report))
    for dry in (True, False):
        with pytest.raises(ToolkitError, match=r"results\[0\]\.folder '\.\./secret' is not a folder inside"):
            do_push(hub, out, dry_run=dry)
    report["results"][0]["folder"] = str(tmp_path / "secret")
    (out / "report.json").write_text(json.dumps(report))
    with pytest.raises(ToolkitError, match="is not a folder inside"):
        do_push(hub, out, dry_run=True)
    assert hub.log == []


def test_a_link_out_of_the_run_is_not_uploaded(hub, out, tmp_path):
    (tmp_path / "secret.txt").write_text("private")
    (out / "4.0bpw" / "notes.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ToolkitError, match=r"notes\.txt resolves to .*secret\.txt, outside"):
        do_push(hub, out, dry_run=True)


@pytest.mark.parametrize("kw,msg", [({"retries": -1}, "retries must be a whole number >= 0"),
                                    ({"retry_delay": -1.0}, "retry_delay must be a number of seconds >= 0"),
                                    ({"retry_delay": float("nan")}, "retry_delay must be"),
                                    ({"repo": "../.."}, "repo must be USER/NAME, got '../..'"),
                                    ({"repo": "alice/../x"}, "repo must be USER/NAME"),
                                    ({"endpoint": "not a url"}, "endpoint: 'not a url' is not an http(s) URL"),
                                    ({"endpoint": "htp://x"}, "is not an http(s) URL")])
def test_bad_options_are_refused_before_any_request(hub, out, kw, msg):
    from toolkit.core.errors import OptionError

    kw = {"repo": REPO, "endpoint": hub.url, **kw}
    with pytest.raises(OptionError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        push(PushOptions(out_dir=out, **kw))
    assert hub.log == []


@pytest.mark.parametrize("missing", ["tau_top1.png", "3.0bpw/README.md"])
def test_an_interrupted_report_step_is_refused(hub, out, missing):
    (out / missing).unlink()
    with pytest.raises(ToolkitError, match=f"incomplete quantize run \\(no {missing}\\)"):
        do_push(hub, out, dry_run=True)


def test_connection_refused_is_not_a_token_problem(out, monkeypatch):
    import socket

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with pytest.raises(ToolkitError) as e:
        push(PushOptions(repo=REPO, out_dir=out, endpoint=url, retries=1, retry_delay=0.01), token=TOKEN)
    msg = str(e.value)
    assert msg.startswith(f"no connection to {url} (connection refused") and "rejected the token" not in msg
    assert "after 2 attempt(s)" in msg


def test_http_500_is_a_server_error_not_a_token_problem(out, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with broken_server() as url, pytest.raises(ToolkitError) as e:
        push(PushOptions(repo=REPO, out_dir=out, endpoint=url, retries=0), token=TOKEN)
    msg = str(e.value)
    assert msg.startswith(f"a server error at {url}: stopped while checking the token after 1 attempt(s) (HTTP 500)")
    assert "rejected the token" not in msg


def test_pushed_cards_carry_the_upstream_license_and_card(hub, out, tmp_path):
    up = out / "upstream"
    up.mkdir()
    (up / "README.md").write_text("---\nlicense: mit\n---\n# The original drafter\n\nTrained by someone.\n")
    (up / "LICENSE").write_text("MIT License\n")
    do_push(hub, out)
    for branch in ("main", "4.0bpw"):
        card = hub.files(REPO, branch)["README.md"].decode()
        assert "license: mit" in card and "Trained by someone." in card
    assert "upstream/README.md" not in hub.files(REPO, "main")


def test_offline_mode_is_named_and_not_retried(out, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ToolkitError) as e:
        push(PushOptions(repo=REPO, out_dir=out, endpoint="http://127.0.0.1:9", retries=3, retry_delay=10), token=TOKEN)
    assert str(e.value).startswith("the Hub cannot be reached in offline mode") and "after 1 attempt(s)" in str(e.value)


@pytest.mark.parametrize("edit,msg", [
    (lambda r: [r], "report.json: expected a JSON object, got a JSON list"),
    (lambda r: {**r, "results": {"a": 1}}, "field 'results' must be a list"),
    (lambda r: {**r, "results": [3]}, r"results\[0\] must be an object"),
    (lambda r: {**r, "results": [{**r["results"][0], "bits": "four"}]}, r"results\[0\]\.bits must be a number from 1 to 8 bits per weight, got 'four'"),
    (lambda r: {**r, "results": [{**r["results"][0], "folder": 4}]}, r"results\[0\]\.folder must be a folder name"),
    (lambda r: {**r, "results": [{**r["results"][0], "calibrated": "yes"}]}, r"results\[0\]\.calibrated must be true or false"),
    (lambda r: {**r, "results": [{**r["results"][0], "tau": "high"}]}, r"results\[0\]\.tau must be a number from 0 to 1024 tokens per round \(or null\)"),
    (lambda r: {**r, "results": [{**r["results"][0], "exl3": {"speedup": "2x"}}]}, r"results\[0\]\.exl3\.speedup must be"),
    (lambda r: {**r, "bf16": [1]}, "field 'bf16' must be an object or null"),
    (lambda r: {**r, "model": 7}, "field 'model' must be a repo id string"),
])
def test_malformed_report_is_one_line_naming_the_field(out, edit, msg):
    from toolkit.hub.card import run_card

    report = edit(json.loads((out / "report.json").read_text()))
    (out / "report.json").write_text(json.dumps(report))
    for call in (lambda: push(PushOptions(repo=REPO, out_dir=out, dry_run=True)), lambda: run_card(out)):
        with pytest.raises(ToolkitError, match=msg) as e:
            call()
        assert "\n" not in str(e.value)


def test_non_finite_weights_are_never_published(hub, out):
    folder = out / json.loads((out / "report.json").read_text())["results"][0]["folder"]
    weights = np.zeros(64, dtype=np.float16)
    weights[3] = np.nan
    save_file({"norm.weight": weights}, str(folder / "model.safetensors"))
    with pytest.raises(ToolkitError, match=r"tensor 'norm.weight' has non-finite weights \(NaN or inf\)"):
        do_push(hub, out, dry_run=True)
    assert hub.log == []
