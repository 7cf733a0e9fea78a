"""The exllamav3 backend on CPU: imports without CUDA, one-line loading errors, the round capture and the
job bookkeeping of generate_many against a small stand-in for exllamav3's Generator. The real thing runs on
the device (tests/test_exl3_gpu.py and the device_check script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from exl3_fakes import Clock, FakeGenerator, V, ar_reference, make_backend, target_next, timed_backend  # noqa: F401  (re-exported)
from stream_shape import assert_stream_shape

from toolkit.core.errors import ToolkitError
from toolkit.runtime.backend import GenSettings
from toolkit.runtime.events import Round, tokens_of
from toolkit.exl3.hook import JobTrack, build_round, recording_generator_class
from toolkit.exl3.options import ADOPTED, Exl3Options, parse_lever
from toolkit.exl3.calibrate import CALIBRATION_WARM, SPOT_REPS


def test_module_imports_without_exllamav3_or_cuda():
    code = ("import sys, toolkit.exl3.backend, toolkit.runtime.factory; "
            "print('exllamav3' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1], env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    assert out.stdout.strip() == "False"


def test_no_cuda_names_the_gpu_needed(monkeypatch):
    from toolkit.exl3 import loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ToolkitError, match=r"no CUDA GPU.*NVIDIA GPU.*compute capability 8\.0.*--backend torch") as e:
        loading.check_cuda()
    assert "\n" not in str(e.value)


def test_from_dirs_rejects_a_drafter_that_does_not_fit(pair, tmp_path):
    from toolkit.exl3.backend import Exl3Backend

    target, draft = pair
    for key, value, pattern in (("hidden_size", 32, r"hidden_size: drafter has 32, target has 128"),
                                ("target_layer_ids", [0, 9], r"target_layer_ids: tap 9")):
        bad = tmp_path / f"draft-{key}"
        shutil.copytree(draft, bad)
        cfg = json.loads((bad / "config.json").read_text())
        if key == "hidden_size":
            cfg["hidden_size"] = value
        else:
            cfg["dflash_config"]["target_layer_ids"] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ToolkitError, match=rf"drafter .* does not fit target .*: {pattern}"):
            Exl3Backend.from_dirs(target, bad)


def test_memory_check_says_needed_and_free(pair, monkeypatch):
    from toolkit.exl3 import backend as exl3_backend

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (256 * 1024**2, 80 * 1024**3))
    with pytest.raises(ToolkitError, match=r"not enough GPU memory on H200: loading needs about 0\.\d GiB .* 0\.2 GiB is free"):
        exl3_backend.check_memory(pair[0], pair[1], 32768, 32, "H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * 1024**3, 80 * 1024**3))
    exl3_backend.check_memory(pair[0], pair[1], 32768, 32, "H200")


# -- the capture ------------------------------------------------------------------------------------


def test_build_round_refuses_a_draft_record_of_another_shape():
    tr = JobTrack(index=0, prompt_len=3)
    with pytest.raises(ToolkitError, match="exllamav3 records 4 fields per verification round, the toolkit reads 3"):
        build_round(tr, [10, 11], [(0, 4, 1, 0.5)], (10, 12, 13, 14), 1.0, 3.0)


def test_build_round_full_partial_zero_clipped_and_ar():
    tr = JobTrack(0, prompt_len=5)
    drafted = (10, 11, 12, 13)
    r = build_round(tr, [10, 11, 12, 13, 14], [(0, 4, 4)], drafted, 1.0, 3.0)   # full: 4 drafts + bonus
    assert (r.accepted, r.bonus, r.prefill, r.full, r.t_verify_ms) == (4, 14, True, True, 2.0)
    r = build_round(tr, [10, 99], [(0, 4, 4), (5, 4, 1)], drafted, 1.0, 3.0)     # partial, correction 99
    assert (r.accepted, r.bonus, r.prefill) == (1, 99, False)
    r = build_round(tr, [7], [(0, 4, 4), (5, 4, 1), (7, 4, 0)], drafted, 1.0, 3.0)  # zero accepted
    assert r.tokens == [7] and r.drafted == drafted
    assert build_round(tr, [], [(0, 4, 4), (5, 4, 1), (7, 4, 0)], None, 0, 1) is None  # still prefilling
    ar = build_round(JobTrack(1, 3), [42], [], None, 0.0, 2.0)
    assert ar == Round((), 0, 42, 0.0, 2.0, True)
    with pytest.raises(RuntimeError, match="out of step"):
        build_round(JobTrack(2, 3), [10, 12, 5], [(0, 4, 2)], drafted, 0, 1)
    with pytest.raises(RuntimeError, match="without a verified draft"):
        build_round(JobTrack(3, 3), [1, 2], [], None, 0, 1)


def test_recording_generator_keeps_drafted_rows_per_job():
    class Job:
        def __init__(self, done):
            self.done = done

        def is_prefill_done(self):
            return self.done

    class Base:
        def __init__(self):
            self.active_jobs = [Job(True), Job(False), Job(True)]

        def iterate(self):
            return [self.iterate_draftmodel_dflash_gen([], 3)]

        def iterate_draftmodel_dflash_gen(self, results, window):
            return torch.arange(12).view(4, 3)      # pinned buffer: more rows than jobs

    g = recording_generator_class(Base)()
    assert torch.equal(g.iterate()[0], torch.arange(12).view(4, 3))
    a, _, c = g.active_jobs
    assert g.drafted == {id(a): (0, 1, 2), id(c): (3, 4, 5)} and g.t_draft_ms >= 0
    with pytest.raises(ToolkitError, match="no iterate_draftmodel_dflash_gen"):
        recording_generator_class(object)


# -- generate_many against a stand-in Generator (tests/exl3_fakes.py) ---------------------------------------


@pytest.fixture
def fake_backend(monkeypatch, tmp_path):
    return make_backend(monkeypatch, tmp_path)


def test_generate_many_rounds_match_the_tokens(fake_backend):
    prompts = [[1, 2, 3], [4, 9], [20, 21, 22, 23], [30]]
    st = GenSettings(max_new_tokens=40, block_size=6)
    per_job = {i: [] for i in range(len(prompts))}
    for i, r in fake_backend.generate_many(prompts, st):
        per_job[i].append(r)
    for i, p in enumerate(prompts):
        rounds = per_job[i]
        assert tokens_of(rounds) == ar_reference(p, 40)
        assert_stream_shape(rounds, width=5, max_new_tokens=40)
        assert rounds[0].prefill and not any(r.prefill for r in rounds[1:])
    seen = {r.accepted for rs in per_job.values() for r in rs[:-1]}
    assert {0, 5} <= seen and seen & {1, 2, 3, 4}              # zero, full and partial acceptance


def test_ar_mode_same_cache_new_generator(fake_backend):
    spec = list(fake_backend.generate([7, 8], GenSettings(max_new_tokens=30)))
    g_spec = fake_backend.engine.gen
    ar = list(fake_backend.generate([7, 8], GenSettings(max_new_tokens=30), speculative=False))
    assert fake_backend.engine.gen is not g_spec and fake_backend.engine.gen.window == 0
    assert tokens_of(ar) == tokens_of(spec) == ar_reference([7, 8], 30)
    assert all(r.drafted == () for r in ar) and len(ar) == len(tokens_of(ar))
    assert_stream_shape(ar, width=0, max_new_tokens=30)


def test_generate_many_checks_its_inputs(fake_backend):
    with pytest.raises(ToolkitError, match="prompt is empty"):
        list(fake_backend.generate([], GenSettings()))
    with pytest.raises(ToolkitError, match="9 jobs exceed max_concurrency 8"):
        list(fake_backend.generate_many([[1]] * 9, GenSettings()))
    with pytest.raises(ToolkitError, match="exceeds the context of 4096"):
        list(fake_backend.generate([1] * 4090, GenSettings(max_new_tokens=10)))


def test_torch_stream_has_the_same_shape(pair_backend):
    ids = pair_backend.tokenizer.encode("Return a new list of the items")
    rounds = list(pair_backend.generate(ids, GenSettings(max_new_tokens=24, block_size=8)))
    assert_stream_shape(rounds, width=7, max_new_tokens=24)


# -- the drafting policy on exllamav3 (issue 16) ----------------------------------------------------------


def endless_prompts(n: int, length: int = 300) -> list[list[int]]:
    """Prompts whose AR continuation never reaches the EOS id 5 within `length` tokens."""
    out = [[s] for s in range(6, V) if len(ar_reference([s], length)) == length]
    return out[:n]


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """A backend whose rounds advance a fake clock by 10 + 2 w c ms, and whose drafter is right on 3 ids."""
    clock = Clock()
    monkeypatch.setattr(FakeGenerator, "clock", clock)
    monkeypatch.setattr(FakeGenerator, "good", staticmethod(lambda last, block: 3))
    be = make_backend(monkeypatch, tmp_path)
    be.clock = clock
    return be


def test_fixed_widths_share_one_generator_and_ar_has_its_own(fake_backend):
    p = endless_prompts(1, 30)[0]
    r6 = list(fake_backend.generate(p, GenSettings(max_new_tokens=30, block_size=6)))
    g = fake_backend.engine.gen
    r3 = list(fake_backend.generate(p, GenSettings(max_new_tokens=30, block_size=3)))
    assert fake_backend.engine.gen is g and len(FakeGenerator.built) == 1   # built once, for B-1
    assert g.max_draft_tokens == 7
    assert g.widths == [5] * len(r6) + [2] * len(r3)                   # the width of each iterate, as asked
    assert tokens_of(r6) == tokens_of(r3) == ar_reference(p, 30)
    assert_stream_shape(r3, width=2, max_new_tokens=30)
    assert all(r.proposed == len(r.drafted) for r in r3)               # fixed: the drafter's block is not kept
    list(fake_backend.generate(p, GenSettings(max_new_tokens=5), speculative=False))
    assert fake_backend.engine.gen is not g and fake_backend.engine.gen.draft_model is None


def test_calibration_per_concurrency_is_timed_once_and_cached(timed, monkeypatch, tmp_path):
    t1 = timed.book.table(1)
    assert t1.ms[1] == pytest.approx({w: 10.0 + 2.0 * w for w in (0, 1, 3, 5, 7)})     # widths clipped to B-1 = 7
    assert timed.engine.gen.num_remaining_jobs() == 0                                  # the dummy jobs are gone
    shapes = []
    iterate = FakeGenerator.iterate
    monkeypatch.setattr(FakeGenerator, "iterate", lambda g: shapes.append((len(g.active_jobs), g.window)) or iterate(g))
    t4 = timed.book.table(4)
    assert set(t4.ms) == {1, 4} and t4.ms[4] == pytest.approx({w: 10.0 + 8.0 * w for w in (0, 1, 3, 5, 7)})
    assert {(j, w) for j in (1, 2, 3, 4) for w in (0, 1, 3, 5, 7)} <= set(shapes)     # the batches' tails warmed too
    monkeypatch.setattr(FakeGenerator, "iterate", iterate)
    files = sorted(p.name for p in (tmp_path / "costs").glob("*.json"))
    assert len(files) == 2 and "-c1-" in files[0] and "-c4-" in files[1]
    again = make_backend(monkeypatch, tmp_path)                       # same models, GPU and options: read back
    again.clock = timed.clock
    got = again.book.table(4)
    assert got.ms[4] == pytest.approx(t4.ms[4]) and got.source.startswith("cached")
    assert set(FakeGenerator.built[0].widths) == {0, 7}                                # a spot check of AR and w=7:
    assert FakeGenerator.built[0].widths.count(7) == CALIBRATION_WARM + SPOT_REPS      # warm passes, then timed ones
    again.set_options(Exl3Options())                                  # other options: timed on their own
    again.book.table(4)
    assert len(FakeGenerator.built) == 2 and len(list((tmp_path / "costs").glob("*.json"))) == 3


def test_a_cached_table_that_no_longer_holds_is_timed_again(monkeypatch, tmp_path):
    before = timed_backend(monkeypatch, tmp_path, lambda w, rows: 10.0 + 2.0 * w * rows)
    assert before.book.table(1).ms[1][7] == pytest.approx(24.0)
    busy = timed_backend(monkeypatch, tmp_path, lambda w, rows: 30.0 + 2.0 * w * rows)   # the GPU is shared now
    table = busy.book.table(1)
    assert table.ms[1][0] == pytest.approx(30.0) and table.ms[1][7] == pytest.approx(44.0)
    assert table.source == "timed now (the cached AR step took 10 ms, now 30 ms)"
    same = timed_backend(monkeypatch, tmp_path, lambda w, rows: 31.0 + 2.0 * w * rows)   # within x1.5: kept
    assert same.book.table(1).source.startswith("cached") and same.book.table(1).ms[1][0] == pytest.approx(30.0)


def test_auto_learns_acceptance_and_settles_on_the_best_width(timed):
    p = endless_prompts(1)[0]
    rounds = list(timed.generate(p, GenSettings(max_new_tokens=300)))           # auto is the default
    assert tokens_of(rounds) == ar_reference(p, 300)
    gen = timed.engine.gen
    assert [len(r.drafted) for r in rounds] == gen.widths[-len(rounds):]        # each Round: what its iterate verified
    assert all(r.proposed == (7 if r.drafted else 0) for r in rounds)           # the drafter's whole block was kept
    tail = {len(r.drafted) for r in rounds[len(rounds) // 2:]}
    assert tail == {3}                       # acceptance 1 up to 3 ids, 0 after; rounds cost 10 + 2w: w = 3 is best
    pol = timed.book.policies[(True, ADOPTED.tag)]
    assert pol.count > 50 and pol.jobs == {}
    e = pol.expected_tokens()
    assert e[3] > 3.85 and e[7] - e[3] < 0.2


def test_a_batch_starts_from_the_carried_rates_not_from_its_prefill_blocks(monkeypatch, timed):
    real = FakeGenerator.iterate_draftmodel_dflash_gen

    def junk_at_prefill(self, results, window):             # as on a GPU: the prefill iterate's block never matches
        ids = real(self, results, window)
        for j, job in enumerate(self.active_jobs):
            if job.new_tokens == 0:
                ids[j] = (ids[j] + 1) % V
        return ids

    monkeypatch.setattr(FakeGenerator, "iterate_draftmodel_dflash_gen", junk_at_prefill)
    monkeypatch.setattr(FakeGenerator, "cost", staticmethod(lambda w, rows: 10.0 + 0.1 * w * rows))   # drafting pays
    st = GenSettings(max_new_tokens=60)
    list(timed.generate(endless_prompts(1, 60)[0], st))                  # the drafter is right on 3 ids: learnt
    pol = timed.book.policies[(True, ADOPTED.tag)]
    assert pol.expected_tokens([s / pol.total[1] for s in pol.total[0]])[3] > 3.5
    timed.book.table(8)                                                   # 8 jobs timed before the request
    before = len(timed.engine.gen.widths)
    per_job = {}
    for i, r in timed.generate_many(endless_prompts(8, 60), st):
        per_job.setdefault(i, []).append(r)
    widths = timed.engine.gen.widths[before:]
    assert widths[1] >= 3 and all(len(rs[1].drafted) >= 3 for rs in per_job.values())   # drafting from the start


def test_auto_decodes_ar_where_speculation_cannot_win_and_probes_only_at_the_budget_spacing(timed):
    prompts = endless_prompts(8, 60)
    per_job = {i: [] for i in range(8)}
    for i, r in timed.generate_many(prompts, GenSettings(max_new_tokens=60)):
        per_job[i].append(r)
    for i, p in enumerate(prompts):
        assert tokens_of(per_job[i]) == ar_reference(p, 60)
    rounds = [r for rs in per_job.values() for r in rs if not r.prefill]
    ar = [r for r in rounds if not r.drafted]
    spec = [r for r in rounds if r.drafted]
    pol = timed.book.policies[(True, ADOPTED.tag)]
    assert len(ar) == len(rounds) and not spec                      # at c=8 a round costs 10 + 16 w: AR
    assert pol.gap(8) > len(rounds) // 8                            # a probe would cost over 3 % of these rounds
    assert all(r.proposed == 0 and r.accepted == 0 and len(r.tokens) == 1 for r in ar)
    assert set(timed.book.tables[timed.book.source.key()].ms) == {8}


def test_a_warm_up_whose_one_proposal_fails_does_not_send_the_next_answer_to_plain_ar(monkeypatch, tmp_path):
    # the app's GPU demo once decoded every answer plain: the warm-up's one rejected proposal had taught the policy
    # that drafting never pays, and each turn restored that state
    be = timed_backend(monkeypatch, tmp_path, lambda w, rows: 32.0 if w == 0 else 38.0 + 0.1 * w)
    monkeypatch.setattr(FakeGenerator, "good", staticmethod(lambda last, block: 0))
    be.warm_up([1, 2, 3])
    assert be.book.policies == {}                               # the warm-up leaves the policies as it found them
    assert be.cost_source() == "timed now"                      # what the app's start-up line reports
    monkeypatch.setattr(FakeGenerator, "good", staticmethod(lambda last, block: 3))
    rounds = list(be.generate([4, 9, 11], GenSettings(max_new_tokens=60)))
    assert sum(1 for r in rounds if r.drafted) > len(rounds) // 2


def test_options_rebuild_the_generator_and_levers_parse(fake_backend):
    p = endless_prompts(1, 20)[0]
    list(fake_backend.generate(p, GenSettings(max_new_tokens=10, block_size=8)))
    assert fake_backend.engine.gen is not None
    fake_backend.set_options(Exl3Options())
    assert fake_backend.engine.gen is None and fake_backend.options.tag == "stock"
    fake_backend.set_options(None)                                     # the defaults again
    assert fake_backend.options == ADOPTED and ADOPTED.tag == "graph_draft_swa,grouped_moe,union_moe"
    assert parse_lever("graph_draft_swa=off+grouped_moe=off+union_moe=off", ADOPTED)[1] == Exl3Options()
    assert parse_lever("graph-draft-swa+grouped-moe+union-moe")[1] == ADOPTED
    with pytest.raises(ToolkitError, match="unknown lever 'chunked_verify'"):
        parse_lever("chunked_verify")
    with pytest.raises(ToolkitError, match="lever graph_draft_swa: bad value 'x'"):
        parse_lever("graph_draft_swa=x")


# -- the capture with a per-round width --------------------------------------------------------------------


class Done:
    def is_prefill_done(self):
        return True


class Drafting:
    """exllamav3's drafting call: the drafter's block is 7 ids, the first `window` come back (4 pinned rows)."""

    def __init__(self):
        self.active_jobs, self.asked, self.num_draft_tokens = [Done(), Done()], [], 7

    def iterate(self):
        return self.iterate_draftmodel_dflash_gen([], self.num_draft_tokens)

    def iterate_draftmodel_dflash_gen(self, results, window):
        self.asked.append(window)
        return torch.arange(28).view(4, 7)[:, :window]


def test_hook_takes_the_whole_block_and_verifies_the_first_w():
    g = recording_generator_class(Drafting)()
    a, b = g.active_jobs
    g.set_width(2, full=7)
    assert g.iterate().shape == (4, 2) and g.asked == [7]
    assert g.proposals[id(a)] == tuple(range(7)) and g.drafted == {id(a): (0, 1), id(b): (7, 8)}
    g.set_width(3)                                       # a fixed width: exllamav3 is asked for exactly that
    g.iterate()
    assert g.asked[-1] == 3 and g.proposals[id(b)] == g.drafted[id(b)] == (7, 8, 9)
    g.set_width(4, full=7)
    g.iterate()
    r = build_round(JobTrack(0, 3), [0, 1, 2, 9], [(1, 4, 3)], g.drafted[id(a)], 1.0, 4.0, len(g.proposals[id(a)]))
    assert (r.drafted, r.accepted, r.bonus, r.proposed) == ((0, 1, 2, 3), 3, 9, 7)


class FakeMoE:
    """An MoE layer class for the MoE wrap to find."""

    def forward(self, x, params, out_dtype=None):
        return x


def test_the_grouped_moe_lever_wraps_the_moe_layers_and_reports_its_paths(monkeypatch, tmp_path):
    from toolkit.exl3.moe import MoeForward

    moe = FakeMoE()
    be = make_backend(monkeypatch, tmp_path, model=[moe], moe_class=FakeMoE)
    assert isinstance(vars(moe)["forward"], MoeForward) and be.options.tag == "graph_draft_swa,grouped_moe,union_moe"
    assert be.engine_report() == {"moe_paths": {"union": 0, "packed": 0, "grouped": 0, "stock": 0}}     # on by default
    be.set_options(Exl3Options(graph_draft_swa=True))
    assert "forward" not in vars(moe) and be.engine_report() is None


def test_without_triton_the_grouped_moe_lever_stays_off_with_one_warning(monkeypatch, tmp_path):
    import toolkit.exl3.moe as gm

    moe = FakeMoE()
    monkeypatch.setattr(gm, "missing", lambda: "Triton is not installed")
    with pytest.warns(UserWarning, match="grouped_moe off: Triton is not installed"):
        be = make_backend(monkeypatch, tmp_path, model=[moe], moe_class=FakeMoE)
    assert be.options == Exl3Options(graph_draft_swa=True) and "forward" not in vars(moe)
