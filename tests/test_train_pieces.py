"""Training in pieces (--time-limit, --resume, --extend, --checkpoint-precision) on a tiny random target, CPU:
a run cut into pieces gives the drafter of the run in one go (bit-for-bit with exact checkpoints, within a stated
tolerance with compact ones), the best evaluation is kept across pieces (and written where its weights are), an
extended run keeps its warm-up and stretches its cosine; the checkpoint format itself (parts, checksums, bounds)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import toolkit.train.checkpoint as ck
import toolkit.train.optim as optim
import toolkit.train.trainer as td
from toolkit.assets.fixtures import build
from toolkit.core.errors import OptionError, ToolkitError
from toolkit.train.batchgen import generate_into
from toolkit.train.data import Item, split
from toolkit.train.pieces import Clock, load_state
from toolkit.train.prepare import group, store_meta
from toolkit.train.store import AnswerStore

SMALL = dict(layers=2, heldout_chat=2, heldout_code=2, steps=12, batch_seqs=8, anchors=6, anchor_chunk=4, lr=3e-3,
             warmup=3, log_every=1, eval_every=4, eval_tokens=16, checkpoint_every=4, quiet=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random target and an answer store made beforehand, with its held-out prompts."""
    root = tmp_path_factory.mktemp("pieces")
    target, _ = build(root, "llama", 16, 0)
    pool = [Item(f"Tell me about item number {i} in the list of things.", "chat") for i in range(400)]
    pool += [Item(f"def f{i}(x):\n    return x * {i} + 1\n", "code") for i in range(150)]
    train, held = split(pool, {"chat": 30, "code": 20}, {"chat": 2, "code": 2})
    from toolkit.runtime.hf import load_hf_model, load_hf_tokenizer

    m, tok = load_hf_model(str(target), "cpu", torch.float32), load_hf_tokenizer(str(target))
    store = AnswerStore(root / "data", store_meta(str(target), 24), len(tok))
    generate_into(store, m, tok, train, 24, 16, 256, quiet=True)
    (root / "data" / "heldout.json").write_text(json.dumps(group(held)))
    return root, str(target)


def train(fx, name: str, **kw) -> dict:
    root, target = fx
    return td.train_drafter(target, str(root / name), **{"data": str(root / "data"), **SMALL, **kw})


@pytest.fixture
def stop_at(monkeypatch):
    """`stop_at(step)`: the next piece's time runs out when it reaches `step` (as the clock would, at a known step)."""
    def at(step: int | None):
        monkeypatch.setattr(Clock, "over", lambda self, st: step is not None and st.step >= step)
    return at


def weights(data, name: str) -> dict:
    return load_file(str(data[0] / name / "model.safetensors"))


def test_pieces_with_exact_checkpoints_are_the_run_in_one_go(data, stop_at):
    root = data[0]
    whole = train(data, "w")
    stop_at(6)
    first = train(data, "p", time_limit=1e6)
    assert (first["steps"], first["complete"], first["written"], first["stopped"]) == (6, False, False, "time limit")
    assert not (root / "p").exists() and (root / "p.ckpt" / "state" / "checkpoint.json").is_file()
    man = json.loads((root / "p.ckpt" / "state" / "checkpoint.json").read_text())
    assert man["step"] == 6 and man["planned"] == 12 and not man["complete"] and man["precision"] == "exact"
    stop_at(None)
    rest = train(data, "p", time_limit=1e6, resume=True)
    assert (root / "p" / "model.safetensors").read_bytes() == (root / "w" / "model.safetensors").read_bytes()
    assert rest["losses"] == whole["losses"] and rest["evals"] == whole["evals"] and rest["best"] == whole["best"]
    assert [(p["piece"], p["from"], p["to"]) for p in rest["pieces"]] == [(1, 0, 6), (2, 6, 12)]
    assert rest["complete"] and rest["written"] and (root / "p.ckpt").is_dir()          # kept: the run may be extended
    assert "in 2 pieces resumed from checkpoints" in (root / "p" / "README.md").read_text()


def test_pieces_with_compact_checkpoints_stay_within_the_stated_tolerance(data, stop_at):
    calm = dict(lr=1e-3, steps=24, eval_every=0)        # the drafter is then the last weights, not the best's
    whole = train(data, "cw", **calm)
    stop_at(16)
    train(data, "c", time_limit=1e6, checkpoint_precision="compact", **calm)
    stop_at(None)
    rest = train(data, "c", time_limit=1e6, resume=True, checkpoint_precision="compact", **calm)
    assert rest["pieces"][1]["replayed"] == 16                          # the first moment, rebuilt from 16 steps
    a, b = weights(data, "c"), weights(data, "cw")
    for k in a:         # eight steps on from bf16 weights, a rebuilt first moment, a 4.4 % second: within 1 % (0.5 % seen)
        assert (a[k].float() - b[k].float()).norm() <= 0.01 * b[k].float().norm(), k
    for (s, x), (_, y) in zip(rest["losses"], whole["losses"]):
        assert abs(x - y) <= 0.01 * abs(y), s


def test_the_best_evaluation_is_kept_across_pieces(data, stop_at, monkeypatch):
    root = data[0]
    real, scores, kept = td.tf_tau, {4: 3.0, 8: 2.0, 12: 2.5}, {}

    def scripted(model, ev, embed, head, sizes, chunk):
        r = real(model, ev, embed, head, sizes, chunk)
        step = 4 * (len(kept) + 1)
        kept[step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
        return {**r, "score": scores[step]}
    monkeypatch.setattr(td, "tf_tau", scripted)
    stop_at(6)
    train(data, "b", time_limit=1e6)                                    # the best, step 4, is found in piece 1
    best_dir = root / "b.ckpt" / "best"
    shutil.move(best_dir, root / "best-elsewhere")                      # left behind: not carried to piece 2
    stop_at(None)
    info = train(data, "b", time_limit=1e6, resume=True)
    assert info["complete"] and not info["written"] and not (root / "b").exists() and info["best"]["step"] == 4
    assert [e["step"] for e in info["evals"]] == [4, 8, 12] and not best_dir.exists()
    monkeypatch.setattr(td, "load_target", lambda *a: pytest.fail("the finished run loads no target weights"))
    with pytest.raises(ToolkitError, match="weights of step 4 .* not in .*best"):
        train(data, "b", time_limit=1e6, resume=True)
    shutil.move(root / "best-elsewhere", best_dir)                      # where the best weights are
    again = train(data, "b", resume=True, data=None)                    # the plan is done: no answers read
    out = weights(data, "b")
    assert again["written"] and all(torch.equal(out[k], kept[4][k]) for k in kept[4])
    assert (root / "b.ckpt" / "state").is_dir()                         # a run made in pieces keeps its checkpoint
    assert "Kept: step 4" in (root / "b" / "README.md").read_text()


def test_an_extended_run_keeps_its_warm_up_and_stretches_its_cosine(data, monkeypatch):
    root = data[0]
    first = train(data, "e", time_limit=1e6, steps=8)
    assert first["complete"] and first["planned_steps"] == 8
    calls = []
    real = optim.lr_factor
    monkeypatch.setattr(optim, "lr_factor", lambda step, steps, warmup: calls.append((step, steps)) or real(step, steps, warmup))
    info = train(data, "e", time_limit=1e6, steps=12, extend=True, resume=True)
    assert calls[0] == (8, 12) and real(8, 12, 3) == pytest.approx(0.25)             # no warm-up: the longer cosine
    assert info["steps"] == info["planned_steps"] == 12 and info["pieces"][-1]["extended"] == [8, 12]
    assert [s for s, _ in info["losses"]] == list(range(12)) and [e["step"] for e in info["evals"]] == [4, 8, 12]
    assert json.loads((root / "e.ckpt" / "state" / "checkpoint.json").read_text())["planned"] == 12
    with pytest.raises(OptionError, match="planned for 12 steps and this command plans 8"):
        train(data, "e", time_limit=1e6, steps=8, resume=True)
    for fewer in (10, 12):
        with pytest.raises(OptionError, match=f"{fewer} steps is not more than the run's 12"):
            train(data, "e", time_limit=1e6, steps=fewer, resume=True, extend=True)
    with pytest.raises(OptionError, match="give it with --resume"):
        train(data, "x", extend=True)
    with pytest.raises(OptionError, match="give one or the other"):
        train(data, "x", time_limit=60, minutes=1)
    assert not (root / "x").exists()


def test_a_piece_ends_in_time_on_the_real_clock(data):
    info = train(data, "t", time_limit=0.01)                            # spent before the first step
    assert (info["steps"], info["stopped"], info["written"]) == (0, "time limit", False)
    _, record = load_state(data[0] / "t.ckpt")
    assert record["optim"]["step"] == 0 and record["pieces"][0]["to"] == 0


def test_compact_encoding_bounds_and_parts(tmp_path, monkeypatch):
    torch.manual_seed(0)
    w, m = torch.randn(256, 250) * 0.02, torch.randn(256, 250) * 1e-4
    v = m.square() * torch.rand(256, 250)
    v[0, :3] = 0
    blob = ck.encode({"w": (w, "bf16"), "m": (m, "q8"), "v": (v, "log8"), "x": (w, "f32"), "s": (torch.tensor(3.0), "raw")},
                     {"note": [1, 2]})
    t, record = ck.decode(blob, "here")
    assert record == {"note": [1, 2]} and torch.equal(t["x"], w) and t["s"].item() == 3.0
    assert ((t["w"] - w).abs() <= w.abs() * 2**-8).all()                           # bf16: half an ulp
    blocks = m.flatten().view(-1, ck.BLOCK).abs().amax(1).repeat_interleave(ck.BLOCK).view(256, 250)
    assert ((t["m"] - m).abs() <= blocks / 254 + 1e-12).all()                      # q8: half a step of the block's
    ratio = t["v"][v > 0] / v[v > 0]
    assert 2 ** (-1 / 8) - 1e-6 <= ratio.min() and ratio.max() <= 2 ** (1 / 8) + 1e-6   # log8: 1/8 octave
    assert (t["v"][v == 0] == 0).all()
    compact = ck.encode({"w": (w, "bf16"), "m": (m, "q8"), "v": (v, "log8")}, {})
    assert len(compact) < 0.3 * 3 * w.numel() * 4                                  # vs three fp32 tensors
    monkeypatch.setattr(ck, "PART_BYTES", 50_000)
    man = ck.write_parts(tmp_path / "s", blob, ck.MANIFEST, {"step": 1})
    assert len(man["parts"]) > 2 and ck.read_parts(tmp_path / "s", ck.read_manifest(tmp_path / "s", ck.MANIFEST)) == blob
    part = tmp_path / "s" / "part.01"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    with pytest.raises(ToolkitError, match="part.01 is damaged"):
        ck.read_parts(tmp_path / "s", man)
    with pytest.raises(ToolkitError, match="not a checkpoint"):
        ck.decode(b"something else", "there")


def test_bad_piece_options_and_checkpoints_are_one_line(data, tmp_path):
    from toolkit.core import cli
    from toolkit.train.pieces import load_state

    root, target = data
    base = ["--target", target, "--out", str(tmp_path / "o"), "--data", str(root / "data")]
    for extra, msg in [(["--extend"], "^--extend: raises the planned steps of a run being continued"),
                       (["--time-limit", "60", "--minutes", "1"], "^--time-limit: --minutes fits the schedule"),
                       (["--resume"], "^--resume: no checkpoint in"), (["--time-limit", "0"], "^--time-limit must be")]:
        with pytest.raises(ToolkitError, match=msg):
            cli.run(td.train_drafter, td.TrainConfig, base + extra, "prog")
    state = tmp_path / "ck" / "state"
    ck.write_parts(state, ck.encode({}, {"planned": "many"}), ck.MANIFEST, {})
    with pytest.raises(ToolkitError, match="not a checkpoint this toolkit can resume"):
        load_state(tmp_path / "ck")
    assert not (tmp_path / "o").exists()
