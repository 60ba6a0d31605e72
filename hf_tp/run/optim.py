"""The optimizer and its learning-rate schedule (AdamW, linear warmup then cosine decay), and
resuming the schedule's position. Shared with the estimate, which builds the loop's optimizer."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch

from hf_tp.compat.torch_internals import set_last_lr
from hf_tp.run.config import TrainConfig

ADAMW_BETAS = (0.9, 0.95)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95); fused on GPUs: one kernel for the whole update, no temporaries of
    the parameters' size (also the HF Trainer's default there)."""
    return torch.optim.AdamW(
        params, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay, fused=device.type == "cuda" or None
    )


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The multiple of the peak lr at 0-based optimizer step ``step``: linear warmup
    ``(step + 1) / (warmup + 1)`` (so the first step already trains, at lr / (warmup + 1), and step
    ``warmup`` is the first at the peak), then cosine decay to ``min_ratio`` at step ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """:func:`lr_factor`: linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    factor = functools.partial(lr_factor, warmup=cfg.warmup_steps, total=cfg.max_steps, min_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def restore_schedule_position(sched: torch.optim.lr_scheduler.LRScheduler, state: dict) -> None:
    """Resume a :func:`build_scheduler` schedule at the saved step, keeping this run's shape.

    LambdaLR's ``state_dict`` also holds its lambda's arguments (the saving run's ``max_steps``);
    loading them would make a run resumed with a larger ``--max-steps`` keep decaying towards the
    old end. Only the position is restored, and the rate of that position recomputed (the
    optimizer's state, loaded before, holds the saving run's rate)."""
    sched.load_state_dict({**state, "lr_lambdas": [None] * len(state.get("lr_lambdas", []))})
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
    for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    set_last_lr(sched, lrs)  # what get_last_lr() reports
