"""Gradient accumulation over pipeline steps with FSDP2 inside the stages.

torch's ``PipelineStage`` infers its tensors' shapes at its first micro-batch with a real forward
and backward, then sets ``.grad`` of every parameter under an FSDP2 module to None: the
gradients earlier micro-steps of a ``--grad-accum`` step accumulated (and, with gradient sync
on, the ones FSDP2 reduced in that inference's backward) would be lost, as the stages are rebuilt
each micro-step. So a pipeline step takes the gradients out before the schedule runs and adds
them back after (:func:`held_grads`, :func:`give_back`). A micro-step before the last runs its
backward passes with FSDP2's sync off (unsharded gradients accumulate, as FSDP2's gradient
accumulation does without pp); the last one then keeps sync off too and reduces once after the
schedule (:func:`reduce_accumulated`, what torch's schedules do for a stage that is itself the
FSDP2 root). A step of one micro-step reduces per pipeline micro-batch as FSDP2 does by itself,
which holds one unit's unsharded gradients at a time rather than the whole stage's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def held_grads(models: list[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every parameter's accumulated gradient, taken out (``.grad`` set to None)."""
    held = []
    for model in models:
        for p in model.parameters():
            if p.grad is not None:
                held.append((p, p.grad))
                p.grad = None
    return held


def give_back(held: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add the gradients :func:`held_grads` took out to what the parameters hold now."""
    for p, grad in held:
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)


def set_sync(models: list[nn.Module], sync: bool) -> None:
    """FSDP2's gradient reduction on or off for every stage model (and its FSDP2 units)."""
    for model in models:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync)


def reduce_accumulated(models: list[nn.Module]) -> None:
    """Reduce-scatter what the backward passes accumulated with sync off, into each parameter's
    sharded gradient (FSDP2's post-backward of every unit, then its root's final callback)."""
    for model in models:
        if not isinstance(model, FSDPModule):
            continue
        model.set_requires_gradient_sync(True)
        root = fully_shard.state(model)
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root._root_post_backward_final_callback()
