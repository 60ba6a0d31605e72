"""The single-rank reference: plain HF on the whole batch, run by every rank on its own device.

No hf_tp model code runs here: HF's ``labels=`` loss (the token mean of the batch), torch's
AdamW and torch's gradient clipping, as one device trains the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_tp.compat.transformers_private import can_set_experts_implementation
from hf_tp.run.optim import ADAMW_BETAS
from hf_tp.verify.compare import full_buffers, full_grads, full_params


@dataclass
class Trace:
    """What a run did, in global views: the first forward's logits (this rank's tokens under
    context parallelism), the losses and gradient norms of each step, the first gradients (and
    every step's as the optimizer took them), the buffers, and the trainable weights before the
    first step and after the last."""

    logits: torch.Tensor | None = None
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    step_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each step's, clipped (as AdamW saw them)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    start: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Settings:
    """The optimizer the two runs share (``hf-tp train``'s AdamW at a constant rate) and the steps."""

    steps: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0


def optimizer(model: nn.Module, s: Settings, fused: bool = False) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=s.lr, betas=ADAMW_BETAS, weight_decay=s.weight_decay, fused=fused or None)


def inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


def reference_run(model: nn.Module, batch: dict[str, torch.Tensor], s: Settings) -> Trace:
    """The trace of ``s.steps`` steps of ``model`` on the whole ``batch``."""
    trace = Trace()
    opt = optimizer(model, s)
    with torch.no_grad():
        trace.logits = model(**inputs(batch), use_cache=False).logits.detach().clone()
    trace.buffers = full_buffers(model)
    trace.start = full_params(model, trainable_only=True)
    for step in range(s.steps):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        if step == 0:
            trace.grads = full_grads(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        trace.grad_norms.append(torch.nn.utils.clip_grad_norm_(trainable, s.max_grad_norm).item())
        trace.step_grads.append(full_grads(model))
        trace.losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    trace.params = full_params(model, trainable_only=True)
    return trace


def exact_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The first gradients of a float64 copy of ``model`` on ``batch``: what the fp32 reference's
    own round-off is measured against (:mod:`hf_tp.verify.measured`)."""
    twin = copy.deepcopy(model).double()
    for module in twin.modules():  # torch's grouped_mm, transformers' default experts kernel, has no float64
        if hasattr(module, "set_experts_implementation") and can_set_experts_implementation(module):
            module.set_experts_implementation("eager")  # reaches its sub-models too
            break
    twin(**batch, use_cache=False).loss.backward()
    return full_grads(twin)
