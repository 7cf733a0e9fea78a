"""Hostile values for every option of every command: a clean refusal or a clean run, never a traceback or data loss.

For each command `python -m toolkit` lists (and app.py), every option of its options dataclass gets a set of
hostile values chosen by the option's role: numbers get nan, inf, negative, zero and huge values; input files get
binary, non-UTF-8, empty, deeply nested JSON, corrupt gzip and oversized files, paths under a file and folders;
input folders get broken model and run folders (report.json or upstream/ linked out of the run); outputs get
files, paths under files, a user's folder, a forged own-output marker and symlinks; devices get names this machine
does not have; free text gets empty, unicode and control characters. Each command line runs in-process
(`main(argv)` under core.errors.run_cli), in a fresh folder holding the user's files, with the model loading and
other heavy work replaced by a stub that records that the checks were passed (REACHED).

Every case must end in exit 0 or REACHED (a value the command may accept) or exit 2 with `error: ...` as the last
line of stderr, and never in an exception. A value that must be refused (a number out of every sensible domain, a
file that is not text, an output that is not the command's own) must end with exit 2 before any work, naming the
flag (numbers) or the file (files). Nothing of the user's changes in any case; a refused case leaves no new file.
The values are fixed, or drawn from a generator seeded with SEED, so a failure reproduces.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fuzz_harness import app_main, fill, inputs, judge, main_of, make_case, run_case, signature, stubs  # noqa: F401
from fuzz_options import BASE_FOR, CASES, COMMANDS, ROLES, SEED, flag_for, options_of, values_for, with_value
from toolkit.__main__ import commands


def check_option(cmd: str, name: str, tp, main, inputs, tmp_path, monkeypatch) -> list[str]:
    names, _ = inputs
    rng = random.Random(f"{SEED}-{cmd}-{name}")
    problems = []
    for k, v in enumerate(values_for(cmd, name, tp, rng)):
        folder = tmp_path / f"c{k}"
        make_case(folder)
        argv = [fill(a, {**names, "case": str(folder)}) for a in with_value(cmd, name, v.text)]
        before = signature(folder)
        r = run_case(main, argv, folder, monkeypatch)
        why = judge(v, flag_for(cmd, name), r, before, signature(folder))
        if why:
            problems.append(f"FUZZFAIL {cmd} {flag_for(cmd, name)}={v.name}: {why}")
    return problems


# --- the tests ----------------------------------------------------------------------------------------------------

def test_every_command_is_fuzzed():
    assert set(commands()) == set(COMMANDS), "a new command needs its base command line and roles here"
    for cmd, roles in ROLES.items():
        have = {n for n, _ in options_of(cmd)}
        assert set(roles) <= have, (cmd, set(roles) - have)
    assert len(CASES) >= 100


BASES = [(cmd, None) for cmd in [*COMMANDS, "app"]] + list(BASE_FOR)


@pytest.mark.parametrize("cmd,name", BASES, ids=[f"{c}-{n or 'base'}" for c, n in BASES])
def test_base_command_line_passes_the_checks(cmd, name, inputs, stubs, app_main, tmp_path, monkeypatch):
    """The base lines are accepted, so a refusal in the cases is the hostile value's doing."""
    names, _ = inputs
    make_case(tmp_path / "c")
    c = COMMANDS.get(cmd)
    base = BASE_FOR.get((cmd, name), c.base) if c else []
    argv = [fill(a, {**names, "case": str(tmp_path / "c")}) for a in (c.sub if c else []) + base]
    r = run_case(main_of(cmd, app_main), argv, tmp_path / "c", monkeypatch)
    assert r["exc"] is None and r["code"] in (0, "reached"), (argv, r)


@pytest.mark.parametrize("cmd,name,tp", CASES, ids=[f"{c}-{n}" for c, n, _ in CASES])
def test_hostile_values(cmd, name, tp, inputs, stubs, app_main, tmp_path, monkeypatch):
    problems = check_option(cmd, name, tp, main_of(cmd, app_main), inputs, tmp_path, monkeypatch)
    names, sig = inputs
    now = signature(Path(names["inputs"]))                  # once, not once per entry: the tree holds ~180
    changed = sorted(k for k, s in sig.items() if now.get(k) != s)
    assert not changed, f"inputs changed: {changed[:5]}"
    assert not problems, "\n".join(problems)
