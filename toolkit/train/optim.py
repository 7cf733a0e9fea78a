"""One optimisation loop for every model the toolkit trains: AdamW, linear warm-up, cosine decay, clipping.

The tiny pair calls it plainly; the drafter trainer adds resumable state, a checkpoint callback, and either a
wall-clock deadline (the cosine is refitted every REFIT steps to the steps the deadline leaves) or a stop test that
ends one piece of a run whose schedule stays as planned (--time-limit).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from ..core.errors import ToolkitError


REFIT = 50                                         # steps between refits of the schedule to a deadline


@dataclass
class OptimState:
    """Where a run stands: resumable from a checkpoint (optimizer state, step, planned steps, the loss log)."""

    step: int = 0
    steps: int = 0
    losses: list = field(default_factory=list)    # [step, loss] every log_every steps
    optimizer: dict | None = None
    stopped: str = ""                              # "", "deadline", "time limit"


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()                  # time the steps, not the kernel queue
    return time.time()


RISE = 2.0                                         # a smoothed loss this many times its start: diverging
SMOOTH = 0.1                                       # weight of each step in the smoothed loss
SETTLE = 10                                        # steps before a rise is judged (the first batches vary)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    return (min(1.0, step / warmup) if warmup > 0 else 1.0) * 0.5 * (1 + math.cos(math.pi * step / steps))


@dataclass
class Divergence:
    """Stops a run whose loss is no longer a number, or whose smoothed loss has risen RISE times over its start
    (a learning rate far too high): training on would only write a broken model."""

    start: float | None = None
    smooth: float | None = None
    seen: int = 0

    def check(self, loss: float, step: int) -> None:
        if not math.isfinite(loss):
            raise ToolkitError(f"training diverged: the loss is {loss} at step {step} (lower --lr, or check the data); "
                               "nothing was written")
        self.smooth = loss if self.smooth is None else (1 - SMOOTH) * self.smooth + SMOOTH * loss
        self.seen += 1
        if self.seen == 1:
            self.start = loss
        if self.seen > SETTLE and self.smooth > RISE * self.start:
            raise ToolkitError(f"training diverged: the loss rose from {self.start:.3f} to {self.smooth:.3f} by step "
                               f"{step} (lower --lr); nothing was written")


def optimize(model, loss_fn: Callable[[], torch.Tensor], steps: int, lr: float, desc: str, warmup: int = 50,
             state: OptimState | None = None, on_step: Callable[[OptimState], None] | None = None,
             deadline: float | None = None, log_every: int = 50, weight_decay: float = 0.01, quiet: bool = False,
             stop: Callable[[OptimState], bool] | None = None) -> OptimState:
    """AdamW with `warmup` warm-up steps and a cosine decay, gradients clipped at 1; loss_fn() gives one batch's loss
    (or, having called backward on its parts itself, that loss detached).
    `state` resumes a run; `on_step(state)` runs after every step; `deadline` (time.time()) ends it early, the
    schedule refitted to it; `stop(state)`, asked before every step, ends it early with the schedule unchanged."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    st = state or OptimState(steps=steps)
    if st.optimizer is not None:
        opt.load_state_dict(st.optimizer)
    st.steps = st.steps or steps
    mark, t_mark = st.step + 5, None              # refit the schedule to the deadline: first after 10 timed steps,
    timed = 0                                      # then every REFIT (a short budget gets a fitted schedule too)
    bar = tqdm(total=st.steps, initial=st.step, desc=desc, unit="step", disable=quiet)
    guard = Divergence()
    while st.step < st.steps:
        if deadline is not None:
            if st.step == mark:
                now = _now()
                if t_mark is not None:             # early steps are slow (warm-up, allocator): refitting keeps up
                    per = (now - t_mark) / timed
                    st.steps = max(st.step + 1, min(steps, st.step + int((deadline - now) / per)))
                    bar.total = st.steps
                timed = REFIT if t_mark is not None else 10
                mark, t_mark = st.step + timed, now
            if time.time() >= deadline:
                st.stopped = "deadline"
                break
        if stop is not None and stop(st):
            st.stopped = "time limit"
            break
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(st.step, st.steps, warmup)
        opt.zero_grad()
        loss = loss_fn()
        if loss.requires_grad:                     # else loss_fn back-propagated its chunks itself (accumulation)
            loss.backward()
        guard.check(loss.item(), st.step)          # before the step: a NaN never reaches the weights
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if st.step % log_every == 0:
            st.losses.append([st.step, round(loss.item(), 4)])
            bar.set_postfix(loss=f"{loss.item():.3f}")
        st.step += 1
        bar.update()
        if on_step is not None:
            st.optimizer = opt.state_dict()
            on_step(st)
    bar.close()
    st.optimizer = opt.state_dict()
    return st
