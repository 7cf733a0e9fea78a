"""Hostile JSON values and their edits for tests/test_bad_input_files.py's property test: huge, odd, non-finite and
deeply nested values (Hypothesis strategies), every place in a document and the edits at them, TOML documents of
the same values, and the verdict on a read (a clean result or one `error:` line)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import strategies as st

from toolkit.core.errors import run_cli

# --- hostile values -------------------------------------------------------------------------------------------------

HUGE = [10**400, -10**400, 10**4000, 2**63, -2**63 - 1, 2**31, 10**18]
ODD = [-1, 0, 1, 1e308, -1e308, 5e-324, 0.5, -0.0, True, False, None, "", "12", "nan", "x" * 300, "\x00", "é", [], {}]


def nested(depth: int, leaf=1):
    """A list `depth` levels deep (deeper than the readers' cap of 64 from 65 on)."""
    out = leaf
    for _ in range(depth):
        out = [out]
    return out


LEAF = st.one_of(st.sampled_from(HUGE + ODD), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                 st.text(max_size=6))
VALUE = st.one_of(LEAF, st.sampled_from([math.nan, math.inf, -math.inf]),      # NaN/Infinity: not JSON at all
                  st.lists(LEAF, max_size=4), st.dictionaries(st.text(max_size=5), LEAF, max_size=3),
                  st.integers(2, 200).map(nested))


def paths(obj, at=()) -> list[tuple]:
    """Every place in a JSON value (the root included)."""
    out = [at]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out += paths(v, at + (k,))
    return out


def mutate(obj, edits):
    """`obj` with each (place, op, value) edit applied: set the value there, drop it, or rename its key."""
    obj = json.loads(json.dumps(obj))
    for place, op, value in edits:
        if not place:
            obj = value if op == "set" else obj
            continue
        parent = obj
        try:
            for k in place[:-1]:
                parent = parent[k]
            key = place[-1]
            if op == "set":
                parent[key] = value
            elif op == "drop":
                del parent[key]
            elif isinstance(parent, dict):
                parent[str(value)[:20]] = parent.pop(key)
        except (KeyError, IndexError, TypeError):
            pass                                          # an earlier edit removed this place
    return obj


def edits(sample):
    ops = st.sampled_from(["set", "set", "drop", "rename"])
    return st.lists(st.tuples(st.sampled_from(paths(sample)), ops, VALUE), min_size=1, max_size=3)


def ends_cleanly(fn) -> str:
    """Run fn as a command runs (core.errors.run_cli): "ok" for exit 0, "error" for exit 2 with one `error:` line.
    Any other exception (run_cli re-raises it) fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_cli(lambda: fn() and None)
    lines = err.getvalue().strip().splitlines()
    assert e.value.code in (0, 2), (e.value.code, lines)
    if e.value.code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return "ok" if e.value.code == 0 else "error"


dump = json.dumps


@contextlib.contextmanager
def scratch():
    with tempfile.TemporaryDirectory(prefix="files-prop-") as d:
        yield Path(d)


# --- TOML ----------------------------------------------------------------------------------------------------------

def toml_value(v) -> str:
    if isinstance(v, (bool, int)):
        return str(v).lower()
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str) or v is None:
        return json.dumps(v or "")                 # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v if x is not None) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None) + "}"


def toml(obj) -> str:
    """A TOML document of a dict of tables (TOML has no null: a None is left out)."""
    if not isinstance(obj, dict):
        return f"x = {toml_value(obj)}\n"
    head = [f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in obj.items() if not isinstance(v, dict) and v is not None]
    body = [f"[{json.dumps(str(k))}]\n" + "\n".join(f"{json.dumps(str(a))} = {toml_value(b)}" for a, b in v.items()
                                                   if b is not None) for k, v in obj.items() if isinstance(v, dict)]
    return "\n".join(head) + "\n\n" + "\n\n".join(body) + "\n"
