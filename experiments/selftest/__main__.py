"""`python -m experiments.selftest [PYTEST ARGS]`: pytest over this folder, under the repository's pytest settings."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "--rootdir", str(HERE.parents[1]), str(HERE), *sys.argv[1:]]))
