"""The one seam to exllamav3 (toolkit/exl3/seams.py): a stand-in exllamav3 package written from the seam table
passes the check; a missing name or a changed signature is one error line naming the seam; optional seams may be
absent; live objects are checked for the attributes the toolkit reads."""

from __future__ import annotations

import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest

from toolkit.core.errors import ToolkitError
from toolkit.exl3 import seams


def write_package(root, drop: str = "", rename: tuple[str, str] | None = None):
    """exllamav3 as a package of stub modules holding every seam (but `drop`; `rename`: (seam, parameter) renamed)."""
    mods: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    for name, seam in seams.SEAMS.items():
        if name == drop:
            continue
        module, _, attrs = seam.path.partition(":")
        params = [("changed" if rename and rename == (name, p) else p) for p in seam.params]
        parts = attrs.split(".")
        mods[module][parts[0]][parts[1] if len(parts) > 1 else ""] = params
    for module in list(mods):                                # every parent package exists
        for i in range(1, module.count(".") + 1):
            mods[".".join(module.split(".")[:i])]
    for module, names in mods.items():
        lines = ["from types import SimpleNamespace"]
        for top, members in names.items():
            if module == "exllamav3.ext":
                fns = ", ".join(f"{m}=lambda *a, **k: None" for m in members)
                lines.append(f"{top} = SimpleNamespace({fns})")
                continue
            own = members.pop("", None)
            if own is not None and not members and top[0].islower():
                lines.append(f"def {top}({', '.join(own)}): pass")
                continue
            body = [f"    def __init__(self, {', '.join(own)}): pass"] if own else []
            body += [f"    def {m}(self, {', '.join(p)}): pass" for m, p in members.items()]
            lines += [f"class {top}:"] + (body or ["    pass"])
        path = root.joinpath(*module.split(".")) / "__init__.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    def make(**kw):
        for m in [m for m in sys.modules if m == "exllamav3" or m.startswith("exllamav3.")]:
            monkeypatch.delitem(sys.modules, m)
        root = tmp_path / f"pkg{len(list(tmp_path.iterdir()))}"
        write_package(root, **kw)
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.setattr(seams, "version", lambda: "1.6.9")
        seams.require.cache_clear()
        return root

    yield make
    seams.require.cache_clear()


def test_every_seam_checks_out_and_resolves(stand_in):
    stand_in()
    seams.require()
    assert seams.get("Generator").__name__ == "Generator" and callable(seams.get("exl3_mgemm"))
    assert seams.get("BlockSparseMLP.forward").__name__ == "forward"


@pytest.mark.parametrize("drop", ["Generator.iterate_draftmodel_dflash_gen", "exl3_mgemm", "BlockSparseMLP.forward", "ArgmaxSampler"])
def test_a_missing_seam_is_one_line_naming_it(stand_in, drop):
    stand_in(drop=drop)
    with pytest.raises(ToolkitError) as e:
        seams.require()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("exllamav3 1.6.9 does not fit this toolkit:") and drop in msg
    assert seams.SEAMS[drop].purpose in msg


def test_a_changed_signature_names_the_parameter(stand_in):
    stand_in(rename=("Generator.iterate_draftmodel_dflash_gen", "window"))
    with pytest.raises(ToolkitError, match=r"iterate_draftmodel_dflash_gen has changed: it takes no 'window'"):
        seams.require()


def pybind(name: str, doc: str):
    """A stand-in for a compiled function: no readable signature, pybind11's signature line as its docstring."""
    return type("builtin", (), {"__name__": name, "__doc__": doc, "__signature__": property(lambda s: 1 / 0)})()


def test_a_compiled_kernel_is_probed_by_its_signature_line():
    seam = seams.SEAMS["exl3_mgemm"]
    params = list(seam.params)
    line = "exl3_mgemm(" + ", ".join(f"{p}: Optional[list[int]]" for p in params) + ", num_tokens: int = 1) -> None\n\nexl3_mgemm"
    assert seams.compiled_params(pybind("exl3_mgemm", line)) == params + ["num_tokens"]
    assert seams.compiled_params(pybind("exl3_mgemm", "exl3_mgemm")) is None       # no signature: nothing to check
    fine, fewer = pybind("exl3_mgemm", line), pybind("exl3_mgemm", line.replace("svh: Optional[list[int]], ", ""))
    import unittest.mock as mock
    with mock.patch.object(seams, "resolve", lambda s: fine):
        assert seams.problem(seam) is None
    with mock.patch.object(seams, "resolve", lambda s: fewer):
        assert "exl3_mgemm has changed: it takes (A, B, C, suh, A_had, indices" in seams.problem(seam)


def test_optional_seams_may_be_missing(stand_in):
    stand_in(drop="chunk_gated_delta_rule")
    seams.require()
    assert seams.get("chunk_gated_delta_rule") is None


def test_not_installed_says_how(monkeypatch):
    monkeypatch.setattr(seams, "version", lambda: None)
    seams.require.cache_clear()
    with pytest.raises(ToolkitError, match=r"exllamav3 is not installed.*\[gpu\].*exllamav3>=1\.6\.5,<1\.7"):
        seams.require()
    seams.require.cache_clear()


def test_live_objects_are_checked_for_what_the_toolkit_reads():
    gen = SimpleNamespace(active_jobs=[], draft_model=None, num_draft_tokens=0, cache_owner_serial=1)
    seams.check_instance("Generator", gen)
    del gen.num_draft_tokens
    with pytest.raises(ToolkitError, match=r"a Generator has no 'num_draft_tokens'"):
        seams.check_instance("Generator", gen)


def test_a_loaded_model_is_checked_on_the_first_module_of_each_kind(stand_in):
    stand_in()
    seams.require()

    def make(kind: str, **attrs):
        obj = seams.get(kind)()
        vars(obj).update(attrs)
        return obj

    class Loaded(list):
        config, modules, fwd_modules, logit_layer_idx = None, [], [], None

    weight = dict(trellis=0, suh=0, svh=0, K=4, mcg=False, mul1=True, in_features=128, out_features=128)
    linear = make("Linear", inner=make("LinearEXL3", **weight), quant_type="exl3")
    window = make("SlidingAttention", window_right=0, sliding_window=512)
    cache = SimpleNamespace(max_num_tokens=256)
    seams.check_loaded(Loaded([linear, window, make("SlidingAttention")]), cache)     # the first of a kind only
    del vars(linear.inner)["mul1"]
    with pytest.raises(ToolkitError, match=r"^exllamav3 1\.6\.9: a LinearEXL3 has no 'mul1'"):
        seams.check_loaded(Loaded([linear, window]))
    with pytest.raises(ToolkitError, match=r"a Cache has no 'max_num_tokens'"):
        seams.check_loaded(Loaded(), SimpleNamespace())
    with pytest.raises(ToolkitError, match=r"a Model has no 'config'"):
        seams.check_loaded([])


def test_a_module_function_is_swapped_where_exllamav3_looks_it_up(stand_in):
    stand_in()
    import importlib

    fla = importlib.import_module(seams.SEAMS["chunk_gated_delta_rule"].path.partition(":")[0])
    inner = fla.chunk_gated_delta_rule
    with seams.swapped("chunk_gated_delta_rule", len):
        assert fla.chunk_gated_delta_rule is len
    assert fla.chunk_gated_delta_rule is inner


def test_every_instance_kind_is_a_class_seam():
    assert set(seams.INSTANCE_ATTRS) <= set(seams.SEAMS)
    assert set(seams.MODULE_KINDS + seams.INNER_KINDS) <= set(seams.INSTANCE_ATTRS)
    from toolkit.exl3.graphs import SAFE_STATES

    assert set(SAFE_STATES) | {"SWAState"} <= set(seams.SEAMS)          # recurrent states named by their class

