"""The toolkit reaches exllamav3 only through toolkit/exl3/seams.py, and what it reads there is declared: read from
the sources, so that a new use of an exllamav3 name cannot slip past the seam check. toolkit/moe takes plain
tensors and imports no engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from toolkit.exl3 import seams

ROOT = Path(__file__).parents[1]
SEAMS_FILE = ROOT / "toolkit" / "exl3" / "seams.py"


def reaches_exllamav3(path: Path) -> list[str]:
    """Where a source file imports exllamav3 itself: an import statement, an import_module / __import__ /
    find_spec of an exllamav3 name, or a seam's location read from the table (to import it by hand)."""
    out = []
    is_exl = lambda name: name == "exllamav3" or name.startswith("exllamav3.")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(is_exl(a.name) for a in node.names):
            out.append(f"line {node.lineno}: import")
        elif isinstance(node, ast.ImportFrom) and not node.level and is_exl(node.module or ""):
            out.append(f"line {node.lineno}: from-import")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "SEAMS" for a in node.names):
            out.append(f"line {node.lineno}: imports the seam table")
        elif isinstance(node, ast.Attribute) and node.attr == "SEAMS":
            out.append(f"line {node.lineno}: reads the seam table")
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0] if node.args else None
            if fn in ("import_module", "__import__", "find_spec") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and is_exl(arg.value):
                out.append(f"line {node.lineno}: {fn}({arg.value!r})")
    return sorted(out, key=lambda hit: int(hit.split()[1].rstrip(":")))


def test_the_toolkit_reaches_exllamav3_only_through_the_seams():
    files = [p for p in (ROOT / "toolkit").rglob("*.py") if p != SEAMS_FILE] + [ROOT / "app.py"]
    direct = {str(p.relative_to(ROOT)): hits for p in files if (hits := reaches_exllamav3(p))}
    assert direct == {}, "import exllamav3 names through toolkit/exl3/seams.py (seams.get), never directly"


def test_the_import_check_sees_each_way_in(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import exllamav3\nfrom exllamav3.modules import Linear\nimport importlib\n"
                   "importlib.import_module('exllamav3.vendor.fla')\nfrom .seams import SEAMS\n"
                   "path = seams.SEAMS['Model'].path\nfrom . import exllamav3_docs\n"
                   "x = 'from exllamav3 import Model'\n")
    assert [h.split(":")[0] for h in reaches_exllamav3(src)] == ["line 1", "line 2", "line 4", "line 5", "line 6"]



def attribute_reads(func: ast.AST, bound: dict[str, str]) -> dict[str, set[str]]:
    """The attributes a function reads or sets on the objects its names hold ({source text: kind}): `obj.attr`,
    `getattr(obj, "attr")` / `hasattr(obj, "attr")`, and `g("attr")` through a getter bound as "g"."""
    out: dict[str, set[str]] = {k: set() for k in bound.values()}
    const = lambda a: isinstance(a, ast.Constant) and isinstance(a.value, str)
    for node in ast.walk(func):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in bound:
            out[bound[ast.unparse(node.value)]].add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args, fn = node.args, node.func.id
            if fn in ("getattr", "hasattr") and len(args) > 1 and const(args[1]) and ast.unparse(args[0]) in bound:
                out[bound[ast.unparse(args[0])]].add(args[1].value)
            elif fn == "g" and "g" in bound and args and const(args[0]):
                out[bound["g"]].add(args[0].value)
    return out


def definition(path: str, name: str) -> ast.AST:
    tree = ast.parse((ROOT / "toolkit" / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)


def declared(kinds: str) -> set[str]:
    """What may be read on an object of these kinds ("A+B"): the declared attributes, the methods declared as
    seams, every module's own for a module kind, and the names the toolkit's Generator subclass adds."""
    out: set[str] = set()
    for kind in kinds.split("+"):
        if kind == "RecordingGenerator":
            cls = definition("exl3/hook.py", kind)
            out |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            out |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
            kind = "Generator"
        out |= set(seams.INSTANCE_ATTRS.get(kind, ()))
        members = (kind, "Module") if kind in seams.MODULE_KINDS else (kind,)
        out |= {s.partition(".")[2] for s in seams.SEAMS if s.partition(".")[0] in members}
        if kind in seams.MODULE_KINDS:
            out |= set(seams.INSTANCE_ATTRS["Module"])
    return out


READ_SITES = (      # (file, function or class, {source text in it: the exllamav3 kind it holds})
    ("exl3/moe.py", "applies", {"g": "BlockSparseMLP", "module": "BlockSparseMLP"}),
    ("exl3/moe.py", "exl3_weight", {"lin": "LinearEXL3"}),
    ("exl3/moe.py", "module_layer", {"module": "BlockSparseMLP", "se": "GatedMLP", "sg": "Linear",
                                     "sg.inner": "LinearFP16"}),
    ("exl3/moe.py", "add_shared_stock", {"module": "BlockSparseMLP", "module.shared_experts": "GatedMLP",
                                         "module.shared_gate": "Linear", "module.shared_gate.inner": "LinearFP16"}),
    ("exl3/moe.py", "MoeForward", {"m": "BlockSparseMLP", "self.module": "BlockSparseMLP",
                                   "self.module.gates[0].inner": "LinearEXL3", "m.router_pre_norm": "Module"}),
    ("exl3/draft_levers.py", "applies", {"module": "SlidingAttention"}),
    ("exl3/window_graphs.py", "WindowPreps", {"m": "SlidingAttention", "prep.module": "SlidingAttention"}),
    ("exl3/hook.py", "RecordingGenerator", {"self": "RecordingGenerator", "job": "Job", "j": "Job"}),
    ("exl3/hook.py", "set_policy_width", {"gen": "RecordingGenerator"}),
    ("exl3/engine.py", "generator", {"g": "RecordingGenerator", "self.cache": "Cache"}),
    ("exl3/engine.py", "run", {"gen": "RecordingGenerator", "job": "Job", "ids": "SeqTensor"}),
    ("exl3/engine.py", "retire", {"self.gen": "RecordingGenerator"}),
    ("exl3/engine.py", "close", {"m": "Model"}),
    ("exl3/calibrate.py", "time_rounds", {"gen": "RecordingGenerator", "j": "Job"}),
    ("exl3/swap.py", "swap_draft", {"engine.draft": "Model"}),
    ("exl3/graphs.py", "ForwardGraphs", {"model": "Model", "self.model": "Model", "module": "Module"}),
    ("exl3/graphs.py", "eager_head", {"module": "Module+DFlashInputLayer"}),
    ("exl3/graphs.py", "one_device", {"m": "Module"}),
    ("exl3/taps.py", "Exl3Target", {"self.model": "Model", "self.model.config": "Config", "emb": "Embedding",
                                    "lm": "Linear", "lm.inner": "LinearEXL3+LinearFP16"}),
    ("quant/check.py", "_dense_from_exllamav3", {"model": "Model", "m": "Linear", "m.inner": "LinearEXL3+LinearFP16"}),
)


def test_the_read_check_sees_each_way_in():
    f = ast.parse("def f(module, g):\n    module.a, getattr(module, 'b'), hasattr(module, 'c'), g('d'), module.x.y\n")
    assert attribute_reads(f, {"module": "K", "g": "K"}) == {"K": {"a", "b", "c", "d", "x"}}
    assert declared("SlidingAttention") >= {"window_right", "forward", "_decode_state_prep", "key", "device"}


@pytest.mark.parametrize("site", READ_SITES, ids=lambda s: f"{s[0]}:{s[1]}")
def test_what_the_toolkit_reads_on_exllamav3_objects_is_declared(site):
    path, name, bound = site
    reads = attribute_reads(definition(path, name), bound)
    assert any(reads.values()), f"{path} {name}: no reads found (a renamed variable?)"
    undeclared = {kind: sorted(attrs - declared(kind)) for kind, attrs in reads.items() if attrs - declared(kind)}
    assert undeclared == {}, f"{path} {name} reads what toolkit/exl3/seams.py does not declare"


def test_the_moe_paths_import_no_engine():
    """toolkit/moe takes plain tensors (moe/weights.py); the exllamav3 side builds them (exl3/moe.py)."""
    bad = {}
    for p in sorted((ROOT / "toolkit" / "moe").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [("." * node.level) + (node.module or "")] if isinstance(node, ast.ImportFrom) else []
            hits = [n for n in names if "exllamav3" in n or n.startswith("..exl3") or n.startswith("toolkit.exl3")]
            if hits:
                bad.setdefault(p.name, []).extend(hits)
    assert bad == {}
