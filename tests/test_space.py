"""`python -m toolkit.space export`: the folder, its front matter and requirements, and the ZeroGPU no-op path."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from toolkit.hub import space
from toolkit.app.models import Hardware, ModelSpec, gpu_wrap

ROOT = Path(__file__).resolve().parent.parent


def front(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_export_writes_a_space_folder(tmp_path):
    out = space.export(str(tmp_path / "sp"), target="me/Qwen3-8B-exl3", draft="me/Qwen3-8B-DFlash", hardware="l4x1")
    for name in ("app.py", "requirements.txt", "README.md", "space.json", ".gitattributes", "toolkit/app/ui.py",
                 "toolkit/data/tiny_pair/target/config.json"):
        assert (out / name).is_file(), name
    assert not list(out.rglob("__pycache__"))
    fm = front(out / "README.md")
    assert fm["sdk"] == "gradio" and fm["app_file"] == "app.py" and fm["python_version"] == "3.11"
    assert str(fm["sdk_version"]).startswith("6.") and fm["suggested_hardware"] == "l4x1"
    assert fm["models"] == ["me/Qwen3-8B-exl3", "me/Qwen3-8B-DFlash"] and len(fm["short_description"]) <= 60
    assert "exllamav3==1.6.5" in (out / "requirements.txt").read_text()
    cfg = (out / "space.json").read_text()
    assert ModelSpec.resolve(env={}, defaults=__import__("json").loads(cfg)).target == "me/Qwen3-8B-exl3"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]       # no temp folder left behind


def test_exported_app_runs_from_its_own_folder(tmp_path):
    out = space.export(str(tmp_path / "sp"), hardware="cpu-basic")
    assert "exllamav3" not in (out / "requirements.txt").read_text() and "models" not in front(out / "README.md")
    r = subprocess.run([sys.executable, "app.py", "--help"], cwd=out, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--target" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import toolkit; print(toolkit.__file__)"], cwd=out, capture_output=True,
                       text=True, timeout=60)
    assert Path(r.stdout.strip()).resolve().parent == (out / "toolkit").resolve()


def test_zero_gpu_export_uses_spaces_not_exllamav3(tmp_path):
    req = (space.export(str(tmp_path / "z"), hardware="zero-a10g") / "requirements.txt").read_text().split()
    assert "spaces" in req and not any(r.startswith("exllamav3") for r in req)


def test_export_refuses_bad_input_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    r = subprocess.run([sys.executable, "-m", "toolkit.space", "export", str(tmp_path / "full")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: dir:") and (tmp_path / "full" / "x").read_text() == "keep"
    with pytest.raises(space.ToolkitError, match="give both"):
        space.export(str(tmp_path / "a"), target="me/t")
    monkeypatch.setattr(space, "copy_package", lambda dst: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        space.export(str(tmp_path / "b"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_requirements_match_pyproject():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert space.BASE_REQUIREMENTS == proj["dependencies"]
    assert space.GPU_REQUIREMENTS == proj["optional-dependencies"]["gpu"]
    assert space.DEMO_REQUIREMENTS == proj["optional-dependencies"]["demo"]
    lines = [ln for ln in (ROOT / "requirements.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == space.requirements("l4x1")


def test_spaces_gpu_decorator_is_a_noop_locally():
    spaces = pytest.importorskip("spaces")

    def gen(n):
        yield from range(n)

    wrapped = gpu_wrap(gen, Hardware(zero_gpu=True))      # the ZeroGPU path, off a ZeroGPU machine
    assert list(wrapped(3)) == [0, 1, 2] and callable(spaces.GPU)
