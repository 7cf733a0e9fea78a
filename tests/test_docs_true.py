"""What the pages say against what the code does: generate.md's JSON keys against a real run's output, every ratio a
page or header shows against docs/results.md (with the card it names), no machine path in what ships, and the
quick start's GPU path installing what it runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = (ROOT / "docs/results.md").read_text()
CARDS = ("H100", "H200", "CPU")          # how a page names the card a number was measured on


def documented_keys() -> tuple[set[str], set[str]]:
    """(top-level keys, speedup_spread's keys) of generate.md's JSON contract."""
    text = (ROOT / "docs/generate.md").read_text().split("## The JSON contract", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            keys |= set(re.findall(r"`(\w+)`", line.split("|")[1]))
    also = text.split("Also present:", 1)[1].split("Invariant", 1)[0]
    keys |= {k for k in re.findall(r"`(\w+)`", also) if not k.startswith(("auto",))}
    spread = re.search(r"\| `speedup_spread` \|[^|]*\|([^|]*)\|", text).group(1)
    return keys, set(re.findall(r"`(\w+)`", spread)) - {"runs"}


def test_generate_json_has_exactly_the_documented_keys():
    r = subprocess.run([sys.executable, "-m", "toolkit.generate", "--prompt", "json.dumps", "--compare-ar", "--json",
                        "--block-size", "16", "--max-new-tokens", "24", "--reps", "2"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    keys, spread = documented_keys()
    assert set(out) == keys, (set(out) - keys, keys - set(out))
    assert out["speedup_spread"] is not None and set(out["speedup_spread"]) == spread
    assert out["lockstep"] is True and out["lossless"] is True       # the torch backend on a CPU: lockstep


def ratios(text: str) -> list[tuple[str, str]]:
    """(ratio as written, e.g. "2.04", its paragraph) of every `N.NNx` / `N.NN×` in a text."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        for m in re.finditer(r"(?<![\d.])(\d+\.\d+)(?:-\d+\.\d+)?\s?[x×](?![\w-])", para):
            out.append((m.group(1), para))
    return out


def result_sections() -> list[str]:
    return re.split(r"\n## ", RESULTS)


def pages() -> dict[str, str]:
    """Every page a user reads that may quote a ratio: README, the shipped drafter's card, the guides, the app's
    headers, the Space READMEs."""
    from toolkit.app import ui
    from toolkit.app.models import Loaded
    from toolkit.hub import space

    shipped = ROOT / "toolkit" / "data" / "smollm2_dflash" / "README.md"      # the shipped drafter's card
    out = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md", shipped,
                                                             *sorted((ROOT / "docs").glob("*.md"))]
           if p.name != "results.md" or p.parent.name != "docs"}

    class Be:
        block_size, max_context, supports_thinking = 16, 2048, False

    for kind, name, device in (("smollm2", "exllamav3", "cuda"), ("smollm2", "torch", "cpu"), ("tiny", "torch", "cpu")):
        loaded = Loaded(Be(), demo=True, backend_name=name, device=device, demo_kind=kind)
        out[f"app header {kind} {name}"] = re.sub(r"<[^>]+>", "", ui.header_html(loaded))
    for hw in ("cpu-basic", "l4x1"):
        lines = space.requirements(hw) if hw.startswith("cpu") else ["torch==2.8.0+cu128"]
        out[f"Space README {hw}"] = space.readme(hw, None, None, "T", "3.11", lines)
    return out


def test_every_ratio_a_page_shows_is_in_results_with_its_card():
    sections = result_sections()
    checked = 0
    for page, text in pages().items():
        for value, para in ratios(text):
            where = [s for s in sections if re.search(rf"(?<![\d.]){re.escape(value)}\s?[x×]", s)]
            assert where, f"{page}: {value}x is not in docs/results.md"
            named = [c for c in CARDS if c in para]
            for card in named:
                assert any(card in s for s in where), f"{page}: {value}x on {card}, but results.md has it elsewhere"
            checked += 1
    assert checked >= 6                        # the headers and READMEs do quote ratios: the test is not empty


ABSOLUTE = re.compile(r"""(?:^|["'\s(=])(/(?:tmp|root|home|Users|mnt|work|var|opt|srv)/[^\s"')]*|[A-Za-z]:\\[^\s"')]+)""")
SHIPPED = ("*.json", "*.md", "*.txt", "*.jinja", "*.toml", "*.yaml", "*.yml")


def absolute_paths(folder: Path) -> list[str]:
    found = []
    for pattern in SHIPPED:
        for f in folder.rglob(pattern):
            found += [f"{f.relative_to(folder)}: {m}" for m in ABSOLUTE.findall(f.read_text(errors="replace"))]
    return found


def test_no_machine_path_ships_in_the_package():
    assert absolute_paths(ROOT / "toolkit") == []


def test_no_machine_path_in_a_space_export(tmp_path):
    from toolkit.hub.space import ExportOptions, export

    out = export(ExportOptions(str(tmp_path / "space"), hardware="cpu-basic"))
    assert absolute_paths(out) == []
    local = tmp_path / "draft"
    local.mkdir()
    (local / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    out = export(ExportOptions(str(tmp_path / "space2"), target="USER/T@main", draft=str(local), hardware="cpu-basic"))
    assert absolute_paths(out) == [] and str(tmp_path) not in (out / "space.json").read_text()


def test_quickstart_gpu_path_installs_what_it_runs():
    text = (ROOT / "docs/quickstart.md").read_text().split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    extras = set(re.search(r'pip install -e "?\.\[([\w,]+)\]', block).group(1).split(","))
    assert "gpu" in extras
    if "python app.py" in block:
        assert "app" in extras                     # the app needs gradio


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_the_test_command_says_what_skips(doc):
    text = (ROOT / doc).read_text()
    assert "chromium" in text and "skip" in text and "-m \"not slow\"" in text


def test_app_md_lists_the_keys_of_a_turns_json():
    sys.path.insert(0, str(ROOT / "tests"))
    from app_fakes import FakeBackend

    from toolkit.app.handlers import ChatHandler
    from toolkit.app.models import Loaded

    outs = list(ChatHandler(Loaded(FakeBackend(step_s=0))).respond("hi", [], 16, 20, 0.0, 0, "", False))
    result = outs[-1][-1]
    text = (ROOT / "docs/app.md").read_text().split("the turn as JSON:", 1)[1].split("; each round has", 1)[0]
    documented = set(re.findall(r"`(\w+)`", text.split("(under `auto`", 1)[0] + text.split("else null)", 1)[1]))
    assert set(result) == documented, (set(result) - documented, documented - set(result))


def test_generated_files_state_only_what_is_so(tmp_path, capsys):
    """The Space's README stands alone (a Space holds none of the docs), the export says what it copied and how big
    it is, and a report names exllamav3's version only when exllamav3 made or measured something."""
    from toolkit.hub import space
    from toolkit.hub.howto import requires_line
    from toolkit.quant.report import build_report
    from toolkit.space import main

    for hw in ("cpu-basic", "l4x1", "zero-a10g"):
        lines = space.requirements(hw) if not hw.startswith("l4") else ["torch==2.8.0+cu128"]
        assert "docs/" not in space.readme(hw, None, None, "T", "3.11", lines)
        assert "docs/" not in space.readme(hw, "USER/T", "USER/D", "T", "3.11", lines)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    (draft / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    capsys.readouterr()
    space.export(space.ExportOptions(str(tmp_path / "s"), target="USER/T@main", draft=str(draft), hardware="cpu-basic"))
    assert re.search(r"; the draft folder copied into it, 2\.0 MB\)", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "copied whole into the Space" in capsys.readouterr().out
    report = build_report("m", None, None, 16, 1, None, None, 0, [])
    assert report["exllamav3_version"] is None and "made and measured with" not in requires_line(report)


@pytest.mark.parametrize("kind", ["tiny", "smollm2"])
def test_the_screenshots_show_todays_page(kind):
    """Each screenshot in docs/ was made by the browser test from the page as it is today (its stamp matches the
    page text the page shows now); a header, legend or footer changed since means: run the command again."""
    from screenshots import REGENERATE, SHOTS, fingerprint, stamped

    assert stamped(SHOTS[kind]) == fingerprint(kind), f"{SHOTS[kind].name} shows an older page: {REGENERATE[kind]}"
    assert REGENERATE[kind] in (ROOT / "docs" / "app.md").read_text().replace("\n", " ")


COMMANDS = ("bench", "card", "demo", "eval_tau", "fixtures", "generate", "pad", "preview_run", "push", "quantize",
            "space", "synth", "tiny_pair", "train_drafter")
MEASURE = re.compile(r"(?<![\w.])~?(\d[\d,]*(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)\s?(?:ms|s|seconds?|minutes?|min|hours?|GiB|GB|MiB|MB)\b")
VAGUE = re.compile(r"a minute or two|half a minute|a few (?:seconds|minutes)|(?<!delay )in seconds|\((?:seconds|minutes)\)|"
                   r"(?<!--)minutes\)|about \w+ minutes")


def settings() -> dict[str, float]:
    """Numbers with a unit that pages quote as settings of the code, not measurements: each checked against it."""
    from toolkit.app.handlers import UI_INTERVAL

    return {f"{UI_INTERVAL:g} s": UI_INTERVAL}


def help_texts() -> dict[str, str]:
    import contextlib
    import importlib
    import io

    out = {}
    for name in COMMANDS:
        buf = io.StringIO()
        for argv in (["--help"], ["export", "--help"]) if name == "space" else (["--help"],):
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), contextlib.suppress(SystemExit):
                importlib.import_module(f"toolkit.{name}").main(argv)
        out[f"--help of {name}"] = buf.getvalue()
    return out


def test_every_time_and_size_a_page_or_help_shows_is_in_results_with_its_card():
    """Times and sizes, like ratios, come from a row of docs/results.md (the card, or the CPU and its load); a time
    said in words ("a minute or two") has none, so no page says one."""
    sections, known = result_sections(), settings()
    checked = 0
    for page, text in {**pages(), **help_texts()}.items():
        assert not VAGUE.search(text), f"{page}: {VAGUE.search(text).group(0)!r} is a time with no measurement"
        text = re.sub(r"```.*?```|`[^`]*`", "", text, flags=re.S)          # commands and example messages aside
        for para in re.split(r"\n\s*\n|\n(?=\d+\. |- |\| )", text):          # paragraphs, list items, table rows
            for m in MEASURE.finditer(para):
                if m.group(0).lstrip("~") in known:
                    continue
                where = [s for s in sections if re.search(rf"(?<![\d.]){re.escape(m.group(1))}(?![\d])", s)]
                assert where, f"{page}: {m.group(0)} is not in docs/results.md"
                for card in (c for c in CARDS if c in para):
                    assert any(card in s for s in where), f"{page}: {m.group(0)} on {card}, but results.md has it elsewhere"
                checked += 1
    assert checked >= 10
