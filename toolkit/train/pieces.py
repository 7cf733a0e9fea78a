"""A training run in pieces: what a checkpoint holds, how a piece ends in time, and how a run's plan is kept or
extended.

A run is planned for a number of steps (--steps, or --epochs over the answers): its warm-up and cosine are
functions of the step and that total, so every piece of the run follows one schedule, and step s trains on the
batch and anchors of step s (trainer.Batches, trainer.step_generator) wherever it runs. A piece with --time-limit
stops when the time left would no longer cover saving the checkpoint (and an evaluation), saves, and ends; the
next piece (--resume) continues from that step. --extend raises the planned total of a resumed run: the cosine is
then the one a run planned for the new total from the start would follow, taken from the step reached on (its
learning rate jumps up to that curve's value; the warm-up is not repeated, AdamW's moments being settled by then).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..core.errors import OptionError, ToolkitError
from . import checkpoint as ck
from .optim import OptimState
from .store import Corpus

RESERVE_S = 20.0                   # the least time a piece keeps for its last evaluation and checkpoint
WEIGHTS = {"exact": "f32", "compact": "bf16"}
MOMENTS = {"exact": {"exp_avg": "f32", "exp_avg_sq": "f32"}, "compact": {"exp_avg": None, "exp_avg_sq": "log8"}}
REPLAY = 20                        # steps whose gradients rebuild the first moment of a compact checkpoint


class Run(dict):
    """The run's record (JSON: the checkpoint's and training.json's), with the best weights so far beside it
    (bf16, None where they are not on this machine) and whether they still need saving."""

    def __init__(self, *args, precision: str = "exact", **kw):
        super().__init__(*args, **kw)
        self.precision = precision
        self.best_weights: dict | None = None
        self.best_unsaved = False
        self.heldout: Corpus | None = None


def fingerprint(corpus: Corpus) -> str:
    """What a resume checks the answers by: the sha256 of every sequence's ids, length and answer start, in order."""
    h = hashlib.sha256()
    for a in (corpus.tokens, corpus.offsets, corpus.lengths, corpus.starts):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def corpus_tensors(corpus: Corpus) -> dict:
    return {"heldout.tokens": (torch.from_numpy(corpus.tokens.astype(np.int32)), "raw"),
            **{f"heldout.{k}": (torch.from_numpy(getattr(corpus, k).astype(np.int64)), "raw")
               for k in ("offsets", "lengths", "starts")}}


def corpus_from(tensors: dict, record: dict) -> Corpus | None:
    if "heldout.tokens" not in tensors:
        return None
    arr = {k: tensors[f"heldout.{k}"].numpy() for k in ("tokens", "offsets", "lengths", "starts")}
    return Corpus(arr["tokens"].astype(np.int64), arr["offsets"], arr["lengths"], arr["starts"],
                  list(record["heldout_answers"]["categories"]), list(record["heldout_answers"]["keys"]))


def save_state(ckdir: Path, model, st: OptimState, run: Run) -> dict:
    """CKDIR/state/ (and CKDIR/best/ when the best weights changed since the last save): see train/checkpoint.py."""
    tensors = {f"model.{k}": (v, WEIGHTS[run.precision]) for k, v in model.state_dict().items()}
    opt = st.optimizer or {"state": {}, "param_groups": []}
    for i, s in opt["state"].items():
        for name, t in s.items():
            how = MOMENTS[run.precision].get(name, "raw")
            if how is not None:
                tensors[f"optim.{i}.{name}"] = (t, how)
    tensors["rng.cpu"] = (torch.get_rng_state(), "raw")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = (torch.cuda.get_rng_state(), "raw")
    record = dict(run)
    if run.heldout is not None:
        tensors.update(corpus_tensors(run.heldout))
        record["heldout_answers"] = {"categories": run.heldout.categories, "keys": run.heldout.keys}
    optim = {k: v for k, v in asdict(st).items() if k != "optimizer"}
    record.update(optim=optim, param_groups=opt["param_groups"], precision=run.precision)
    summary = {"format": 1, "step": st.step, "planned": run["planned"], "complete": st.step >= st.steps,
               "precision": run.precision, "best": run["best"], "pieces": run["pieces"]}
    man = ck.write_parts(ckdir / ck.STATE, ck.encode(tensors, record), ck.MANIFEST, summary)
    if run.best_weights is not None and run.best_unsaved:
        blob = ck.encode({k: (v, "bf16") for k, v in run.best_weights.items()}, {"best": run["best"]})
        ck.write_parts(ckdir / ck.BEST, blob, ck.BEST_MANIFEST, {"format": 1, "best": run["best"]})
        run.best_unsaved = False
    return man


RECORD = {"drafter_config": dict, "fingerprint": str, "planned": int, "steps_per_epoch": int, "evals": list,
          "best": (dict, type(None)), "pieces": list, "heldout_prompts": dict, "corpus": dict, "accuracy": list,
          "optim": dict, "param_groups": list}
OPTIM = {"step": int, "steps": int, "losses": list, "stopped": str}


def load_state(ckdir: Path) -> tuple[dict, dict]:
    """(tensors, record) of CKDIR/state/; a record without the fields a resume reads is one line."""
    folder = ckdir / ck.STATE
    man = ck.read_manifest(folder, ck.MANIFEST)
    if man is None:
        raise OptionError("resume", f": no checkpoint in {ckdir} (no {ck.STATE}/{ck.MANIFEST})")
    tensors, record = ck.decode(ck.read_parts(folder, man), str(folder))
    ok = (isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in RECORD.items())
          and set(OPTIM) == set(record["optim"]) and all(isinstance(record["optim"][k], t) for k, t in OPTIM.items())
          and record["steps_per_epoch"] > 0 and "rng.cpu" in tensors)
    if not ok:
        raise ToolkitError(f"{folder}: not a checkpoint this toolkit can resume (fields missing or of other types)")
    return tensors, record


def load_best(ckdir: Path, best: dict | None) -> dict | None:
    """The best weights saved in CKDIR/best/ when they are those of `best` (the record's), else None."""
    folder = ckdir / ck.BEST
    man = ck.read_manifest(folder, ck.BEST_MANIFEST) if best is not None else None
    if man is None or man.get("best") != best:
        return None
    tensors, _ = ck.decode(ck.read_parts(folder, man), str(folder))
    return tensors


def restore(model, tensors: dict, record: dict) -> OptimState:
    """Weights, optimizer and RNG back from a checkpoint; returns the optimizer's state."""
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, i, key = name.split(".", 2)
            state.setdefault(int(i), {})[key] = t
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return OptimState(**record["optim"], optimizer={"state": state, "param_groups": record["param_groups"]})


def rebuild_first_moment(model, loss_at, st: OptimState) -> int:
    """The first AdamW moment that a compact checkpoint leaves out, rebuilt in place from the gradients (clipped as
    in training) of the last REPLAY steps at the resumed weights: m = sum_j (1 - b1) b1^(j-1) g(step - j), scaled by
    1 / (1 - b1^REPLAY) for the older steps it leaves out. Returns the steps replayed (0: nothing was missing)."""
    opt = st.optimizer
    if opt is None or all("exp_avg" in s for s in opt["state"].values()):
        return 0
    params = [p for p in model.parameters() if p.requires_grad]
    beta1, n = opt["param_groups"][0]["betas"][0], min(REPLAY, st.step)
    m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for j in range(1, n + 1):
        model.zero_grad()
        loss = loss_at(st.step - j)
        if loss.requires_grad:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for mi, p in zip(m, params):
            if p.grad is not None:
                mi.add_(p.grad.float(), alpha=(1 - beta1) * beta1 ** (j - 1))
    model.zero_grad()
    scale = 1 / (1 - beta1**n) if 0 < n < st.step else 1.0
    for i, s in opt["state"].items():
        s.setdefault("exp_avg", m[int(i)] * scale)
    return n


def planned_steps(cfg, record: dict, plan: int) -> int:
    """The planned total of a resumed run: the checkpoint's, or this command's with --extend (never fewer)."""
    have = record["planned"]
    field = "epochs" if cfg.epochs else "steps"
    if cfg.extend and plan <= have:
        raise OptionError("extend", f": raises the plan, and {plan} steps is not more than the run's {have}")
    if plan != have and not cfg.extend:
        raise OptionError(field, f": the checkpoint's run is planned for {have} steps and this command plans {plan}: "
                          f"give the run's --{field}, or --extend to raise its plan")
    return plan


def check_resume(record: dict, dcfg: dict, print_: str, ckdir: Path) -> None:
    if record.get("drafter_config") != dcfg or record.get("fingerprint") != print_:
        raise OptionError("resume", f": the checkpoint in {ckdir} is for another drafter shape or other answers")


class Clock:
    """When a piece with a time limit must stop: once the time left no longer covers RESERVE_S plus twice the
    longest checkpoint save and the longest evaluation seen so far."""

    def __init__(self, t0: float, limit: float | None):
        self.end = None if limit is None else t0 + limit
        self.save_s = self.eval_s = 0.0

    def timed(self, kind: str, fn, *args):
        t = time.time()
        out = fn(*args)
        setattr(self, kind, max(getattr(self, kind), time.time() - t))
        return out

    def over(self, _st: OptimState) -> bool:
        return self.end is not None and time.time() + RESERVE_S + 2 * self.save_s + self.eval_s >= self.end


def missing_best(ckdir: Path, best: dict) -> ToolkitError:
    return ToolkitError(f"the drafter is the weights of step {best['step']} (the best evaluation), which are not in "
                        f"{ckdir / ck.BEST}: copy that folder from the machine whose run found them, and run this "
                        "command again")
