"""Training at scale (issue 19), on CPU with tiny models: the batched generator against unbatched generation, the
answer store (append, cut-off, resume, skip), anchor sampling, chunked loss = unchunked, teacher-forced tau =
the rounds of real greedy decoding, best-checkpoint keeping, the training curve, resume and the --data path."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import toolkit.train.trainer as td
from toolkit.train import batchgen
from toolkit.assets.fixtures import build, drafter_config, random_drafter
from toolkit.assets.pairs import tiny_pair
from toolkit.assets.prompts import Prompt
from toolkit.core.cli import parser
from toolkit.core.errors import ToolkitError
from toolkit.runtime.backend import GenSettings, encode_chat
from toolkit.runtime.events import summarize
from toolkit.runtime.torch_backend import TorchBackend
from toolkit.train.batchgen import cut, generate_into, greedy_batch, stop_ids
from toolkit.train.data import Item, is_heldout, split
from toolkit.train.objective import chunked_loss, position_weights, sample_anchors
from toolkit.train.pieces import load_state
from toolkit.train.store import AnswerStore, Row, prompt_key
from toolkit.train.tf_tau import eval_set, matches, tf_tau, walk

NAMES = ["json.dumps", "os.path.join", "re.compile", "collections.Counter", "textwrap.dedent", "heapq.heappush",
         "shutil.copy", "functools.partial", "x", "itertools.chain", "string.capwords", "copy.deepcopy"]


@pytest.fixture(scope="module")
def pair():
    t, d = tiny_pair()
    be = TorchBackend.from_dirs(t, d, device="cpu", dtype=torch.float32)
    return be, [Prompt(n, "chat" if k % 2 else "code") for k, n in enumerate(NAMES)]


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    target, _ = build(root, "llama", 16, 0)
    return root, str(target)


def test_batched_greedy_equals_unbatched_generation(pair, monkeypatch):
    be, prompts = pair
    m, tok = be.target, be.tokenizer
    stops = stop_ids(m, tok)
    ids = [encode_chat(tok, p.text) for p in prompts[:8]]
    ref = []
    for p in ids:                                    # transformers' own greedy generate, one prompt at a time
        g = m.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=40,
                       do_sample=False, eos_token_id=sorted(stops), pad_token_id=0)
        ref.append(cut(g[0, len(p):].tolist(), stops))
    assert len({len(p) for p in ids}) > 3 and len({len(r) for r in ref}) > 3 and any(r[-1] in stops for r in ref)
    assert greedy_batch(m, ids, 40, stops, 0) == ref              # left padding, rows finishing apart, dropped rows
    assert [a for k in range(0, len(ids), 3) for a in greedy_batch(m, ids[k : k + 3], 40, stops, 0)] == ref

    def small_memory(model, prompts, *a):                          # a batch over 3 rows runs out of GPU memory
        if len(prompts) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return greedy_batch(model, prompts, *a)
    monkeypatch.setattr(batchgen, "greedy_batch", small_memory)
    assert batchgen.answer(m, ids, 40, stops, 0) == ref


def test_grouped_decode_attention_is_repeat_kv_attention(random_target):
    """The one-token GQA path (query heads as rows of their K/V head) against transformers' sdpa with repeat_kv, and
    greedy answers of a GQA target (4 query, 2 K/V heads) against its own unbatched generate."""
    from types import SimpleNamespace

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from toolkit.runtime.hf import load_hf_model, load_hf_tokenizer
    from toolkit.train.batchgen import grouped_decode

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 1, 16), torch.randn(2, 3, 20, 16), torch.randn(2, 3, 20, 16)
    mask = torch.rand(2, 1, 1, 20) > 0.3
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    ref, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask, scaling=0.25)
    with grouped_decode():
        got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, ref)
    _, target = random_target
    m, tok = load_hf_model(target, "cpu", torch.float32), load_hf_tokenizer(target)
    assert m.config.num_key_value_heads < m.config.num_attention_heads
    stops = stop_ids(m, tok)
    ids = [encode_chat(tok, t) for t in NAMES[:5]]
    ref = [cut(m.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=24,
                          do_sample=False, eos_token_id=sorted(stops), pad_token_id=0)[0, len(p):].tolist(), stops) for p in ids]
    assert greedy_batch(m, ids, 24, stops, 0) == ref


def test_answer_store_appends_resumes_and_skips(pair, tmp_path):
    be, prompts = pair
    meta = {"max_new_tokens": 24}
    prompts = prompts + [Prompt("a very long prompt " * 30, "chat")]
    full = AnswerStore(tmp_path / "full", meta, 512)
    st = generate_into(full, be.target, be.tokenizer, prompts, 24, 4, max_prompt_tokens=40, quiet=True)
    assert (st.answers, st.skipped, st.pending) == (12, 1, 0) and st.rate()["answers_per_s"] > 0
    assert full.index["dtype"] == "uint16" and len(full) == 13

    cut_off = AnswerStore(tmp_path / "cut", meta, 512, shard_tokens=100)

    def stop_after_two(s):
        if s.answers >= 8:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        generate_into(cut_off, be.target, be.tokenizer, prompts, 24, 4, 40, quiet=True, on_batch=stop_after_two)
    shard = tmp_path / "cut" / f"{cut_off.index['shards'][-1]}.bin"
    with open(shard, "ab") as f:                     # a batch whose ids were written but not its index
        f.write(b"\x01\x00" * 7)
    again = AnswerStore(tmp_path / "cut", meta)
    st2 = generate_into(again, be.target, be.tokenizer, prompts, 24, 4, 40, quiet=True)
    assert (st2.already, st2.answers, st2.skipped) == (9, 4, 0) and len(again.index["shards"]) > 1
    a, b = full.load(), AnswerStore(tmp_path / "cut").load()
    rows = {k: a.row(i).tolist() for i, k in enumerate(a.keys)}
    assert rows == {k: b.row(i).tolist() for i, k in enumerate(b.keys)} and len(rows) == 12
    assert generate_into(again, be.target, be.tokenizer, prompts, 24, 4, 40, quiet=True).already == 13
    ids, lengths, starts = a.batch([0, 1])
    assert ids.shape == (2, int(lengths.max())) and (starts < lengths).all() and a.answer_tokens() > 0
    assert len(full.load(exclude={prompt_key(prompts[0].text)})) == 11
    with pytest.raises(ToolkitError, match="other settings"):
        AnswerStore(tmp_path / "full", {"max_new_tokens": 32})
    with pytest.raises(ToolkitError, match="not an answer store"):
        AnswerStore(tmp_path / "nothing")


def test_anchor_sampling_counts_distinct_fresh_and_short():
    starts, lengths = torch.tensor([3, 10, 5, 7]), torch.tensor([800, 30, 6, 7])   # 796, 19, 0 and 0 valid anchors
    a1, v1 = sample_anchors(starts, lengths, 512, torch.Generator().manual_seed(1))
    a2, _ = sample_anchors(starts, lengths, 512, torch.Generator().manual_seed(2))
    assert a1.shape == (4, 512) and v1.sum(1).tolist() == [512, 19, 0, 0]
    row = a1[0].tolist()
    assert row == sorted(set(row)) and 3 <= row[0] and row[-1] <= 798
    assert a1[1, :19].tolist() == list(range(10, 29))                  # a short answer uses all its anchors
    assert a1[0].tolist() != a2[0].tolist() and a1[1, :19].tolist() == a2[1, :19].tolist()
    everything, v = sample_anchors(starts, lengths, None)
    assert v.sum(1).tolist() == [796, 19, 0, 0] and everything[0, :796].tolist() == list(range(3, 799))


def test_chunked_loss_has_the_gradient_of_the_whole_loss():
    torch.manual_seed(0)
    cfg = drafter_config(64, [0, 1], 3, 8, layers=2, vocab_size=512, window=6, target_layers=4)
    embed, head = torch.randn(512, 64), torch.randn(512, 64) * 0.1
    ids, lengths, starts = torch.randint(4, 512, (3, 40)), torch.tensor([40, 25, 33]), torch.tensor([5, 9, 30])
    taps = torch.randn(3, 40, 128)
    anchors, valid = sample_anchors(starts, lengths, 20, torch.Generator().manual_seed(0))
    grads, losses = [], []
    for chunk in (20, 3):
        model = random_drafter(cfg, std=0.05)
        loss, acc = chunked_loss(model, ids, taps, lengths, anchors, valid, embed, head, position_weights(8), chunk)
        losses.append(loss)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert acc.shape == (7,) and not loss.requires_grad
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_teacher_forced_tau_is_the_tau_of_greedy_decoding(pair, tmp_path):
    """On text like the tiny drafter's training windows (zero, partial and full blocks accepted): every round of
    the decode, at B=16 and B=8, is the teacher-forced walk over the AR answer."""
    from toolkit.train.tiny import corpus

    be, _ = pair
    text_ids = be.tokenizer(corpus()[:40000])["input_ids"]
    windows = [text_ids[k : k + 24] for k in range(100, len(text_ids) - 24, (len(text_ids) - 124) // 6)][:6]
    stops = stop_ids(be.target, be.tokenizer)
    store = AnswerStore(tmp_path / "held", {"max_new_tokens": 40}, 512)
    answers = greedy_batch(be.target, windows, 40, stops, 0)
    store.append([Row(str(k), w + a, len(w), ("chat", "code")[k % 2]) for k, (w, a) in enumerate(zip(windows, answers))])
    data = store.load()
    ev = eval_set(be.target, data, be.drafter.config, "cpu")
    emb, head = be.target.get_input_embeddings().weight, be.target.get_output_embeddings().weight
    ms = matches(be.drafter, ev, emb, head, chunk=7)
    res = tf_tau(be.drafter, ev, emb, head, (16, 8), chunk=64)
    for b in (16, 8):
        pooled = {"chat": [], "code": []}
        for s in range(len(data)):
            rounds = list(be.generate(windows[int(data.keys[s])], GenSettings(max_new_tokens=40, block_size=b)))
            answer = [t for r in rounds for t in r.tokens]
            assert answer == data.row(s)[data.starts[s]:].tolist()              # the stored answer is AR greedy's
            assert walk(ms[s], len(answer), b) == [r.accepted for r in rounds if r.drafted]
            pooled[data.categories[s]] += rounds
        for cat, rs in pooled.items():
            assert res["tau"][cat][str(b)] == pytest.approx(summarize(rs).tau, abs=1e-4)
    accepted = [a for m in ms for a in m]
    assert min(accepted) == 0 and max(accepted) == 15 and any(0 < a < 15 for a in accepted)
    assert res["score"] == pytest.approx((res["tau"]["chat"]["16"] + res["tau"]["code"]["16"]) / 2, abs=1e-4)


SMALL = dict(layers=2, heldout_chat=2, heldout_code=2, max_new_tokens=24, gen_batch=8, steps=12, batch_seqs=4, anchors=6,
             anchor_chunk=4, lr=3e-3, warmup=3, log_every=1, eval_every=4, eval_tokens=16, checkpoint_every=4, quiet=True)


@pytest.fixture(scope="module")
def data(random_target, pair):
    """An answer store made beforehand (as the smol_scale script's gen does), with a held-out prompt in it."""
    root, target = random_target
    pool = [Item(f"Tell me about item number {i} in the list of things.", "chat", f"g{i // 3}", i % 3 > 0) for i in range(600)]
    pool += [Item(f"def f{i}(x):\n    return x * {i} + 1\n", "code") for i in range(150)]
    train, held = split(pool, {"chat": 10**6, "code": 20}, {"chat": 2, "code": 2})
    blocked = {i.group for i in pool if i.group and not i.extra and is_heldout(i.prompt)}
    assert len(held) == 4 and blocked and not {p.text for p in train} & {i.text for i in pool if i.group in blocked}
    assert all(not i.extra for i in pool if i.text in {p.text for p in held})
    train = [p for p in train if p.category == "code"] + [p for p in train if p.category == "chat"][:40]
    from toolkit.runtime.hf import load_hf_model, load_hf_tokenizer

    m, tok = load_hf_model(target, "cpu", torch.float32), load_hf_tokenizer(target)
    from toolkit.train.prepare import group, store_meta

    store = AnswerStore(root / "data", store_meta(target, 24), len(tok))
    generate_into(store, m, tok, train + held[:1], 24, 16, 256, quiet=True)
    (root / "data" / "heldout.json").write_text(json.dumps(group(held)))
    return root, target, len(store.load(exclude={prompt_key(p.text) for p in held}))


def test_best_checkpoint_is_kept_and_the_curve_written(data, monkeypatch):
    root, target, n_train = data
    real, scores, kept = td.tf_tau, {4: 2.0, 8: 3.0, 12: 2.5}, {}

    def scripted(model, ev, embed, head, sizes, chunk):
        r = real(model, ev, embed, head, sizes, chunk)
        step = len(calls) * 4 + 4
        calls.append(step)
        kept[step] = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
        return {**r, "score": scores[step]}
    calls: list = []
    monkeypatch.setattr(td, "tf_tau", scripted)
    info = td.train_drafter(target, str(root / "best"), data=str(root / "data"), curve=str(root / "curve.png"), **SMALL)
    assert calls == [4, 8, 12] and info["best"]["step"] == 8 and [e["step"] for e in info["evals"]] == [4, 8, 12]
    out = load_file(str(root / "best" / "model.safetensors"))
    assert all(torch.equal(out[k], kept[8][k]) for k in kept[8]) and not torch.equal(out["fc.weight"], kept[12]["fc.weight"])
    assert info["sequences"] == n_train                      # the held-out answer in the store is not trained on
    assert set(info["evals"][0]["tau"]) == {"chat", "code"} and set(info["evals"][0]["tau"]["chat"]) == {"16", "8"}
    assert (root / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Kept: step 8" in (root / "best" / "README.md").read_text()
    assert json.loads((root / "best" / "training.json").read_text())["best"]["step"] == 8


RESUME = {**SMALL, "batch_seqs": 8, "epochs": 1.5}                  # 8 batches an epoch: 12 steps


def test_resume_continues_the_step_count_and_the_record(data, interrupt_training):
    root, target, _ = data
    with interrupt_training(8):
        td.train_drafter(target, str(root / "r"), data=str(root / "data"), **RESUME)
    _, ck = load_state(root / "r.ckpt")
    assert ck["optim"]["step"] == 8 and [e["step"] for e in ck["evals"]] == [4, 8]
    assert (root / "r.ckpt" / "best" / "best.json").is_file()
    info = td.train_drafter(target, str(root / "r"), data=str(root / "data"), resume=True, **RESUME)
    whole = td.train_drafter(target, str(root / "w"), data=str(root / "data"), **RESUME)
    assert info["steps"] == whole["steps"] == info["planned_steps"] > 8 and [s for s, _ in info["losses"]] == list(range(info["steps"]))
    assert info["evals"] == whole["evals"] and info["losses"] == whole["losses"]
    assert (root / "r" / "model.safetensors").read_bytes() == (root / "w" / "model.safetensors").read_bytes()


def test_train_drafter_options_come_from_the_dataclass(data):
    ap = parser(td.TrainConfig, "prog")
    a = vars(ap.parse_args(["--target", "T", "--out", "O", "--anchors", "512", "--epochs", "2", "--taps", "1", "2"]))
    assert a["anchors"] == 512 and a["epochs"] == 2.0 and a["taps"] == [1, 2] and a["anchor_chunk"] == 64
    text = ap.format_help()
    assert "--eval-every" in text and "(default 512)" in text and "--curve" in text
    root, target, _ = data
    with pytest.raises(ToolkitError, match="^--data: .* is not an answer store"):
        from toolkit.core.cli import run

        run(td.train_drafter, td.TrainConfig, ["--target", target, "--out", str(root / "z"), "--data", str(root)], "prog")
    assert np.iinfo(np.uint16).max >= 512
