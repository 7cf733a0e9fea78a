"""Every command's --help answers at once: it imports none of the heavy libraries before the arguments are read.

Checked by what a `--help` run imports (`python -X importtime` lists every module a process imports, as the user
runs it: `python -m toolkit.<command> --help`, `python app.py --help`), not by a wall clock: a clock under a busy
machine's load flakes, while importing torch for --help (1.5-9 s on a 2-core CPU) is a cause that does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.__main__ import commands

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "transformers", "exllamav3", "gradio", "gradio_client", "numpy", "matplotlib", "safetensors",
         "accelerate", "tokenizers", "triton"}


def imported(args: list[str]) -> set[str]:
    """The top-level packages a `--help` run of `args` imports; the run must print its usage and exit 0."""
    r = subprocess.run([sys.executable, "-X", "importtime", *args, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, (args, r.stderr[-500:])
    rows = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert len(rows) > 20, r.stderr[-500:]                  # -X importtime did report (the header row included)
    return {name.split(".")[0] for name in rows}


@pytest.mark.parametrize("args", [["-m", f"toolkit.{name}"] for name in sorted(commands())] + [["app.py"]],
                         ids=lambda a: a[-1])
def test_help_imports_no_heavy_library(args):
    heavy = imported(args) & HEAVY
    assert not heavy, f"{' '.join(args)} --help imports {sorted(heavy)}: import them where the work starts"


def test_the_check_sees_a_heavy_import(tmp_path):
    """The check itself: a script that imports a heavy library before its arguments are read is caught."""
    script = tmp_path / "heavy.py"
    script.write_text("import argparse\nimport numpy\nargparse.ArgumentParser(prog='heavy').parse_args()\n")
    assert "numpy" in imported([str(script)]) & HEAVY
