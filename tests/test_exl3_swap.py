"""runtime.exl3_swap on CPU, through exl3_fakes' loader and Generator stand-ins: another drafter in a loaded
exllamav3 backend without loading the target again (the quantize speed step's swap), its placement and cache
as from_dirs gives them, the old drafter out before the new one loads, decoding still AR's tokens, and the
refusals in one line before anything is unloaded."""

from __future__ import annotations

import json
import shutil

import pytest
from exl3_fakes import ar_reference, install_loader

from toolkit.core.errors import ToolkitError
from toolkit.costs.table import CostTable
from toolkit.exl3 import swap as exl3_swap
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import tokens_of
from toolkit.exl3.options import ADOPTED, Exl3Options
from toolkit.exl3.swap import swap_draft
from toolkit.runtime.placement import GpuSplit


def load(pair, monkeypatch, devices=1, split=None, cache_tokens=4096):
    """An Exl3Backend from the fake loader; its Cache calls and the models' unloads are logged beside the loads."""
    from toolkit.exl3.backend import Exl3Backend

    log = install_loader(monkeypatch, devices)
    be = Exl3Backend.from_dirs(*pair, cache_tokens=cache_tokens, max_concurrency=1, split=split)
    make = be.exl.Cache
    caches = []
    be.exl.Cache = lambda model, **kw: caches.append(kw) or make(model, **kw)
    for m in (be.model, be.draft):
        m.unload = lambda m=m: log.append(("unload", m.folder))
    be.vocab_size = 97                                                    # the fake generator's vocabulary
    return be, log, caches


def drafter(pair, tmp_path, name, **change):
    """A copy of the pair's drafter under `name`, its config changed (at the top level and in dflash_config)."""
    d = tmp_path / name
    shutil.copytree(pair[1], d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in change.items():
        for part in (cfg, cfg["dflash_config"]):
            if k in part or part is cfg:
                part[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_swap_keeps_the_target_and_decodes_with_the_new_drafter(pair, tmp_path, monkeypatch):
    be, log, caches = load(pair, monkeypatch)
    target, cache, old = be.model, be.cache, be.draft
    st = GenSettings(max_new_tokens=24, block_size=8)
    list(be.generate([7, 8], st))
    g_old = be.engine.gen
    assert g_old.draft_model is old
    be.book.give(CostTable({1: {0: 1.0, 1: 2.0}}))
    be.book.policies[(True, ADOPTED.tag)] = object()
    new = drafter(pair, tmp_path, "draft-b")
    levers = []
    monkeypatch.setattr(exl3_swap, "set_draft_levers", lambda *a: levers.append(a))
    swap_draft(be, new)
    assert levers == [(be.draft, ADOPTED, Exl3Options(), None)]     # the adopted wraps go onto the new drafter
    # the old drafter unloaded, then only the new one loaded (the target not again), with a cache like the first
    assert log[2:] == [("unload", "draft"), ("draft-b", {"progressbar": False}, False)]
    assert be.model is target and be.cache is cache and be.draft.folder == "draft-b"
    assert caches == [{"max_num_tokens": 4096, "max_batch_size": 1, "max_history": 15}]
    assert be.draft_cache.model is be.draft and be.draft_cache.max_num_tokens == be.cache.max_num_tokens
    assert be.folders == (pair[0], new) and be.book.tables == {} and be.book.policies == {} and be.block_size == 16
    # the next generate builds a Generator over the new drafter; greedy output is still the target's own
    spec = list(be.generate([7, 8], st))
    gen = be.engine.gen
    assert gen is not g_old and gen.draft_model is be.draft and gen.draft_model is not old
    ar = list(be.generate([7, 8], st, speculative=False))
    assert tokens_of(spec) == tokens_of(ar) == ar_reference([7, 8], 24, be.eos_ids)
    assert any(r.drafted for r in spec)


@pytest.mark.parametrize("devices,split,cache_tokens,kw", [
    (1, GpuSplit(), 768, {"max_chunk_size": 768}),                          # a one-job cache: the chunk cut to it
    (2, GpuSplit.of("16,16", draft_device=1), 4096, {"reserve_per_device": [-1, 0.5]}),
    (2, GpuSplit.of("16,16", True), 4096, {"reserve_per_device": [0.5, -1]}),
])
def test_the_new_drafter_loads_where_the_first_did(pair, tmp_path, monkeypatch, devices, split, cache_tokens, kw):
    be, log, _ = load(pair, monkeypatch, devices, split, cache_tokens)
    first = log[0]
    swap_draft(be, drafter(pair, tmp_path, "draft-b"))
    assert log[-1] == ("draft-b", first[1], False) == ("draft-b", {"progressbar": False, **kw}, False)
    assert be.split == split


@pytest.mark.parametrize("change,pattern", [
    ({"block_size": 8}, r"has block size 8, the loaded one 16: load a new backend for it$"),
    ({"hidden_size": 32}, r"does not fit target .*: hidden_size: drafter has 32, target has 128"),
])
def test_a_drafter_that_cannot_swap_in_is_refused_first(pair, tmp_path, monkeypatch, change, pattern):
    be, log, caches = load(pair, monkeypatch)
    old, n = be.draft, len(log)
    with pytest.raises(ToolkitError, match=pattern) as e:
        swap_draft(be, drafter(pair, tmp_path, "bad", **change))
    assert "\n" not in str(e.value)
    assert be.draft is old and len(log) == n and caches == []           # nothing unloaded, nothing loaded


def test_a_load_failure_is_one_line(pair, tmp_path, monkeypatch):
    be, log, _ = load(pair, monkeypatch)
    make = be.exl.Model.from_config

    def broken(name):
        m = make(name)
        m.load = lambda **kw: (_ for _ in ()).throw(OSError("safetensors header is corrupt\nmore"))
        return m

    be.exl.Model.from_config = broken
    with pytest.raises(ToolkitError, match=r"^exllamav3 cannot load drafter .*draft-b: safetensors header is corrupt$"):
        swap_draft(be, drafter(pair, tmp_path, "draft-b"))
