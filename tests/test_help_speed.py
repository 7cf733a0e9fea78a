"""Every command's --help answers at once: no torch, transformers or exllamav3 import before the arguments are read."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.__main__ import commands

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 2.0         # a command that imports torch for --help takes 1.5-9 s on a 2-core CPU; one that does not, ~0.2 s
HEAVY = ("torch", "transformers", "exllamav3", "gradio")


def help_seconds(args: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *args, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 0 and "usage:" in r.stdout, (args, r.stderr[-500:])
    return took


@pytest.mark.parametrize("args", [["-m", f"toolkit.{name}"] for name in commands()] + [["app.py"]],
                         ids=lambda a: a[-1])
def test_help_is_fast(args):
    """The median of two runs stays under the bound even on a busy machine; the heavy imports are checked apart."""
    took = statistics.median([help_seconds(args), help_seconds(args)])
    assert took < BOUND_S, f"{' '.join(args)} --help took {took:.1f} s"


@pytest.mark.parametrize("name", sorted(commands()))
def test_help_imports_no_heavy_library(name):
    """The cause, not only the symptom: --help of each command loads none of torch, transformers, exllamav3, gradio."""
    code = (f"import sys\nsys.argv = ['x', '--help']\nimport toolkit.{name} as m\n"
            "try:\n    m.main(['--help'])\nexcept SystemExit:\n    pass\n"
            f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "[]", (name, r.stdout[-300:], r.stderr[-300:])
