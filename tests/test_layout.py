"""The tree's rules, held here so that they cannot drift: no import circles among toolkit/, experiments/ and tests/
(imports under `if TYPE_CHECKING:` count), no Python file over 400 lines, libraries never import a command (a module
at toolkit's root), no test imports experiments/ (its self-check is `python -m experiments.selftest`), at most 20
experiment scripts, docs/ at most 1,500 lines with docs/results.md at most 300, no tracked file named by a run
number, every command's library entry takes at most 6 parameters (its options object), slow tests
only in tests/slow/, and the policy stays small."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PKG = ROOT / "toolkit"
COMMANDS = {p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__")}
FIRST_PARTY = ("toolkit", "experiments", "tests")
MAX_SCRIPTS = 20            # experiments/*.py, __init__ aside
MAX_DOCS_LINES, MAX_RESULTS_LINES = 1500, 300


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


HELPERS = {p.stem for p in (ROOT / "tests").glob("*.py")}       # tests import their helpers by bare name


def first_party(name: str) -> str | None:
    """`name` as a module path of this tree (a helper of tests/ imported by its bare name is tests.<name>)."""
    top = name.split(".")[0]
    if top in FIRST_PARTY:
        return name
    return f"tests.{name}" if top in HELPERS else None


def imports(path: Path, source: str | None = None) -> set[str]:
    """The first-party modules `path` imports, at any depth of its code: lazy imports and imports under
    `if TYPE_CHECKING:` count too (a type-only circle is still a circle a reader must untangle)."""
    name = module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            out |= {n for a in node.names if (n := first_party(a.name))}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base := first_party(base):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def graph(folders: tuple[str, ...] = ("toolkit",)) -> dict[str, set[str]]:
    mods = {module_name(p): p for d in folders for p in (ROOT / d).rglob("*.py")}
    return {m: {i for i in imports(p) if i in mods and i != m} for m, p in mods.items()}


def test_imports_under_type_checking_and_relative_ones_count():
    code = ("from typing import TYPE_CHECKING\nfrom . import harness\nif TYPE_CHECKING:\n"
            "    from experiments.speed import WORK\n    import stream_shape\n    import numpy\n")
    got = imports(ROOT / "experiments" / "x.py", code)
    assert got == {"experiments", "experiments.harness", "experiments.speed", "experiments.speed.WORK",
                   "tests.stream_shape"}, got


def test_no_import_circles():
    g = graph(FIRST_PARTY)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    # a package's __init__ importing its own modules is not a circle of code
    cycles = [c for c in cycles if not any(a == b.rpartition(".")[0] or b == a.rpartition(".")[0] for a, b in zip(c, c[1:]))]
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_libraries_never_import_a_command():
    for m, deps in graph().items():
        if m.count(".") >= 2:                               # toolkit.<package>.<module>
            bad = {d for d in deps if d.count(".") == 1 and d.split(".")[1] in COMMANDS}
            assert not bad, (m, bad)


def python_files() -> list[Path]:
    """The .py files of toolkit/, tests/ and experiments/ that git tracks or would track (not ignored); every one
    there when git is not at hand."""
    folders = ("toolkit", "tests", "experiments")
    git = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                          *(f"{d}/*.py" for d in folders)], cwd=ROOT, capture_output=True, text=True)
    if git.returncode == 0 and git.stdout:
        return [ROOT / n for n in sorted(set(git.stdout.split("\0"))) if n and (ROOT / n).is_file()]
    return [p for d in folders for p in (ROOT / d).rglob("*.py")]


def test_no_module_over_400_lines():
    files = python_files()
    assert {p.parent.relative_to(ROOT).parts[0] for p in files} == {"toolkit", "tests", "experiments"}
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_no_test_imports_experiments():
    """tests/ checks the product; the measurement scripts check themselves (`python -m experiments.selftest`, in
    CI), so retiring a script never breaks a test."""
    users = set()
    for p in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "experiments" for n in names):
                users.add(str(p.relative_to(ROOT)))
    assert not users, users


def test_at_most_20_experiment_scripts():
    scripts = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__")
    assert len(scripts) <= MAX_SCRIPTS, (len(scripts), scripts)


def test_docs_stay_short():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "docs").rglob("*.md")}
    assert lines["docs/results.md"] <= MAX_RESULTS_LINES, lines["docs/results.md"]
    assert sum(lines.values()) <= MAX_DOCS_LINES, (sum(lines.values()), lines)


def test_slow_tests_live_in_tests_slow():
    """The slow tier is tests/slow/: `-m slow` collects nothing else, and `-m "not slow"` nothing of it (conftest)."""
    marked = [p.name for p in (ROOT / "tests").glob("test_*.py") if re.search(r"mark\.slow\b", p.read_text())]
    assert not marked, f"move {marked} into tests/slow/: the slow tier collects only that folder"


def test_no_tracked_file_is_named_by_a_run_number():
    git = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode != 0 or not git.stdout:
        pytest.skip("git is not at hand: the tracked files are unknown")
    named = [n for n in git.stdout.splitlines() if re.search(r"call\d+", Path(n).name)]
    assert not named, named


def test_runtime_imports_no_engine_and_no_consumer_compares_backend_names():
    g = graph()
    runtime = [m for m in g if m.startswith("toolkit.runtime")]
    assert not [(m, i) for m in runtime for i in g[m] if i.startswith("toolkit.exl3")]
    names = ("exllamav3", "torch")
    compared = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel.startswith("exl3/") or rel == "runtime/registry.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Constant) and s.value in names for s in sides):
                    compared.append(f"{rel}:{node.lineno}")
    assert compared == [], "consumers read Backend.caps (runtime/registry.py) instead of comparing backend names"


def test_placement_is_parsed_without_the_engine_adapter():
    """GpuSplit and its flags live in runtime/placement.py; only exl3/ imports exl3/split.py (its load arguments)."""
    g = graph()
    outside = [m for m in g if not m.startswith("toolkit.exl3") and "toolkit.exl3.split" in g[m]]
    outside += [p.name for p in ROOT.glob("*.py") if "toolkit.exl3.split" in p.read_text()]     # app.py, the Space's entry
    assert outside == []
    assert "toolkit.runtime.placement" in g["toolkit.generate"]


def test_commands_reach_the_engine_adapter_only_through_the_registry():
    """No command (a module at toolkit's root) or app.py imports exl3/ (its levers come by runtime.registry.levers);
    the libraries that drive exllamav3 themselves (quant/, hub's wheel pins) are not commands."""
    g = graph()
    outside = sorted(m for m in g if m.count(".") == 1 and m.split(".")[1] in COMMANDS
                     and any(i.startswith("toolkit.exl3") for i in g[m]))
    outside += [p.name for p in ROOT.glob("*.py") if re.search(r"^\s*(from|import) toolkit\.exl3", p.read_text(), re.M)]
    assert outside == []


MAX_ENTRY_PARAMETERS = 6
CLI_RUNNERS = {"run", "run_sub", "run_cli_options"}          # core.cli's runners, as the commands import them
PIPELINE_ENTRIES = ("toolkit.quant.pipeline:start", "toolkit.quant.pipeline:quantize", "toolkit.hub.space:export")


def command_entries(stem: str) -> list:
    """The functions the command module toolkit/<stem>.py hands to core.cli's runners in its `main`: named, called
    inside a lambda, listed in a subcommand table or bound to a local name first."""
    import importlib
    import inspect

    tree = ast.parse((PKG / f"{stem}.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    local = {t.id: n.value for n in ast.walk(main) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)}
    given = [n.args[0] for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in CLI_RUNNERS and n.args]
    given += [local[n.id] for g in given for n in ast.walk(g) if isinstance(n, ast.Name) and n.id in local]
    module = importlib.import_module(f"toolkit.{stem}")
    found = {getattr(module, n.id, None) for g in given for n in ast.walk(g) if isinstance(n, ast.Name)}
    return sorted((f for f in found if inspect.isfunction(f)), key=lambda f: (f.__module__, f.__name__))


def over_the_limit(functions: list) -> list[str]:
    """"module:function (N parameters)" for each function taking more than MAX_ENTRY_PARAMETERS parameters."""
    import inspect

    return [f"{f.__module__}:{f.__name__} ({n} parameters)" for f in functions
            if (n := len(inspect.signature(f).parameters)) > MAX_ENTRY_PARAMETERS]


def test_library_entries_take_an_options_object():
    """Every command's library entry (what its `main` hands to core.cli), quantize's pipeline and the Space export
    take at most 6 parameters: the options object the command line shares (mlx-lm style), and a few that are not
    flags (a token, a progress switch, a callback)."""
    import importlib

    entries = {stem: command_entries(stem) for stem in sorted(COMMANDS)}
    assert all(entries.values()), [stem for stem, fns in entries.items() if not fns]     # each main runs something
    entries["pipelines"] = [getattr(importlib.import_module(m), f) for m, _, f in
                            (e.partition(":") for e in PIPELINE_ENTRIES)]
    found = {f"{f.__module__}:{f.__name__}" for fns in entries.values() for f in fns}
    assert {"toolkit.bench:bench", "toolkit.generate:generate", "toolkit.eval_tau:eval_tau", "toolkit.hub.space:export",
            "toolkit.quantize:quantize", "toolkit.hub.push:push"} <= found, found
    assert over_the_limit([f for fns in entries.values() for f in fns]) == []


def test_the_entry_rule_sees_a_seventh_parameter():
    def seven(a, b, c, d, e, f, g): ...

    def six(a, b, c, d, e, f): ...

    assert over_the_limit([six, seven]) == [f"{__name__}:seven (7 parameters)"]


def test_the_policy_stays_small():
    """policy/ is the rule a new engineer checks against its docstring: at most 250 lines, 3 classes, 10 knobs
    (module constants; the timed table and its cache live in costs/)."""
    files = list((PKG / "policy").glob("*.py"))
    trees = [ast.parse(p.read_text()) for p in files]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    classes = [n.name for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)]
    knobs = [t.id for tree in trees for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()]
    assert lines <= 250 and len(classes) <= 3 and len(knobs) <= 10, (lines, classes, knobs)


def test_model_files_are_read_only_through_core_tensorfiles():
    """One reader for every model file: a safetensors load (safe_open, load_file, load, or the module itself imported
    to reach them) appears in core/tensorfiles.py only; writing (save_file) and the error type may be imported."""
    allowed = {"save_file", "save", "SafetensorError"}
    found = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel == "core/tensorfiles.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "safetensors" for a in node.names):
                found.append(f"{rel}:{node.lineno} import safetensors")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "safetensors":
                found += [f"{rel}:{node.lineno} {a.name}" for a in node.names if a.name not in allowed]
    assert found == [], "read model files through toolkit.core.tensorfiles (iter_tensors, load_tensors, read_folder)"
