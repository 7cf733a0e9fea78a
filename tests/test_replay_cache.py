"""The policy replay's cached table (tests/replay_cache.py): keyed by a hash of everything the replay reads, and the
one source of the full table (tests/data/replay/table.md) and of the results page's summary. Whether a stale cache
still holds the replay's table is the slow tier's check (tests/slow/test_policy_replay.py)."""

from __future__ import annotations

from pathlib import Path

from tests import replay_cache as C
from tests import replay_table as T
from tests.replay_rivals import ROWS

LABELS = {m: label for m, (label, _) in ROWS.items()}


def cached() -> T.Cells:
    data = C.stored()
    assert data is not None, "tests/data/replay/table.json is missing: python -m experiments.policy_replay table --write"
    return C.from_json(data["cells"])


def test_the_cache_holds_every_scenario_and_mode():
    cells = cached()
    assert list(cells) == [(n, c) for n, s in T.SCENARIOS.items() for c in s[2]]
    assert all(set(cell) == set(ROWS) | {"best"} for cell in cells.values())
    assert C.from_json(C.to_json(cells)) == cells


def test_the_full_table_and_the_results_page_come_from_the_cache():
    cells = cached()
    assert C.FULL.read_text() == C.full_table(cells, LABELS)
    results = (C.ROOT / "docs" / "results.md").read_text()
    assert T.summary(cells, LABELS) in results, "docs/results.md's replay summary differs from the cache's"


def test_the_hash_covers_the_policy_the_rivals_and_every_trace():
    names = {p.relative_to(C.ROOT).as_posix() for p in C.inputs()}
    assert {"tests/replay.py", "tests/replay_table.py", "tests/replay_rivals.py", "toolkit/policy/chooser.py",
            "toolkit/costs/book.py", "toolkit/costs/table.py"} <= names
    assert {f"tests/data/replay/costs_h100_{s[1]}.json.gz" for s in T.SCENARIOS.values()} <= names
    assert "tests/data/replay/lengths_smollm2.json.gz" in names
    assert not {"tests/replay_cache.py", "tests/data/replay/table.json", "tests/data/replay/table.md"} & names


def test_any_change_to_an_input_is_a_mismatch(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "ROOT", tmp_path)
    files = [tmp_path / "a.py", tmp_path / "b.json.gz"]
    for p in files:
        p.write_bytes(b"x")
    before = C.digest(files)
    files[1].write_bytes(b"y")
    assert C.digest(files) != before
    files[1].write_bytes(b"x")
    assert C.digest(files) == before and C.digest(files, seeds=8) != before
    files[0].rename(tmp_path / "c.py")
    assert C.digest([tmp_path / "c.py", files[1]]) != before          # a renamed input too


def test_a_mismatch_sends_the_slow_test_to_the_replay(monkeypatch):
    assert C.fresh_cells() in (None, cached())
    monkeypatch.setattr(C, "digest", lambda *a, **k: "another hash")
    assert C.fresh_cells() is None


def test_lazy_and_helper_imports_are_followed(tmp_path):
    got = {p.relative_to(C.ROOT).as_posix() for p in C.sources((C.ROOT / "tests" / "replay_rivals.py",))}
    assert {"tests/replay.py", "toolkit/__init__.py", "toolkit/policy/__init__.py"} <= got
    assert C.module_files("numpy") == [] and C.module_files("stream_shape") == [C.ROOT / "tests" / "stream_shape.py"]
    assert C.module_files("toolkit.policy.chooser.Policy")[-1] == Path(C.ROOT / "toolkit" / "policy" / "chooser.py")
