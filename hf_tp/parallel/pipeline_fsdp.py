"""FSDP2 inside pipeline stages: each stage's gradients reduced once, after the schedule's step.

A hf_tp stage wraps its HF model, the FSDP2 root; torch's pipelining drives FSDP2 by hand only for
a stage module that is itself one, and otherwise leaves FSDP2's own hooks to fire, which misses
in two ways:
- torch's schedules infer each stage's shapes with a real forward and backward of the first
  micro-batch, after which they drop the gradients of every FSDP2 module's parameters
  (``PipelineStage._post_metadata_inference_cleanup``). hf_tp builds the schedule per step, so
  with ``--grad-accum`` the gradients an earlier micro-step reduce-scattered (or that this one's
  shape pass reduced) were dropped: pp x dp training with gradient accumulation was wrong.
- Schedules that split the backward (``zbv``, ``dualpipev``: input gradients first, weight
  gradients later from the same graph) see FSDP2's hooks fire with the input part, before any
  weight gradient exists; resharded layers then give the weight part other Parameters (torch's
  ``KeyError: <AccumulateGrad ...>``).
So, as torch does for its own roots, a stage's units accumulate gradients unreduced through the
schedule's step (split-backward schedules also keep the gathered weights), and after it every
unit runs FSDP2's post-backward by hand: the reduce-scatter on the micro-step that syncs, the
reshard. The shape pass's backward computes input gradients only, so nothing of it is reduced.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def fsdp_roots(models: list[nn.Module]) -> list[FSDPModule]:
    """The stages' FSDP2 roots (none without dp), checked to expose the FSDP2 internals this module
    drives (torch 2.13's: a torch that renamed them is refused here, on every rank alike)."""
    roots = [m for m in models if isinstance(m, FSDPModule)]
    for root in roots:
        state = fully_shard.state(root)
        ctx = getattr(state, "_state_ctx", None)
        if (
            ctx is None
            or not hasattr(state, "_root_post_backward_final_callback")
            or not all(hasattr(s, "_fsdp_param_groups") for s in ctx.all_states)
        ):
            raise RuntimeError(
                f"--pp with FSDP2 (dp > 1) drives FSDP2's internals as torch 2.13 has them; torch {torch.__version__} "
                "lacks them: install torch 2.13 or train with --pp 1"
            )
    return roots


def keep_gathered(roots: list[FSDPModule]) -> None:
    """Every unit of ``roots`` keeps its gathered weights after its forward (set once, at build)."""
    for root in roots:
        root.set_reshard_after_forward(False)


def hold_gradients(roots: list[FSDPModule], split_backward: bool) -> list[tuple[bool, list]]:
    """Before a schedule's step: set aside the gradients the stages' parameters already hold (the
    earlier micro-steps', which the schedule's shape pass would drop), and let each root's units
    accumulate gradients unreduced (a ``split_backward`` schedule's also keep their gathered
    weights after backward). Returns, per root, whether it was set to reduce this micro-step
    (the caller's gradient-accumulation choice) and what was set aside."""
    held = []
    for root in roots:
        params = [fp.sharded_param for s in _states(root) for g in s._fsdp_param_groups for fp in g.fsdp_params]
        sync = all(g.reduce_grads for s in _states(root) for g in s._fsdp_param_groups)
        held.append((sync, [(p, p.grad) for p in params if p.grad is not None]))
        for p in params:
            p.grad = None
        if split_backward:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)
    return held


def release_gradients(roots: list[FSDPModule], held: list[tuple[bool, list]]) -> None:
    """After the step: FSDP2's post-backward of every unit by hand (the reduce-scatter where the
    root was set to reduce, the reshard) and its root's end-of-backward callback; then the
    gradients set aside are added back."""
    for root, (sync, kept) in zip(roots, held, strict=True):
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(sync)
        for state in _states(root):
            for group in state._fsdp_param_groups:
                group.post_backward()
        fully_shard.state(root)._root_post_backward_final_callback()
        for param, grad in kept:
            param.grad = grad if param.grad is None else grad + param.grad


def _states(root: FSDPModule) -> list:
    return list(fully_shard.state(root)._state_ctx.all_states)
