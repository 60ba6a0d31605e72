"""FSDP2 inside pipeline stages: each stage's gradients reduced once, after the schedule's step.

A hf_tp stage wraps its HF model, the FSDP2 root; torch's pipelining drives FSDP2 by hand only for
a stage module that is itself one, and otherwise leaves FSDP2's own hooks to fire, which misses
in two ways:
- torch's schedules infer each stage's shapes with a real forward and backward of the first
  micro-batch, after which they drop the gradients of every FSDP2 module's parameters
  (``PipelineStage._post_metadata_inference_cleanup``). hf_tp builds the schedule per step, so
  with ``--grad-accum`` the gradients an earlier micro-step reduce-scattered (or that this one's
  shape pass reduced) were dropped: pp x dp training with gradient accumulation was wrong. The
  cleanup visits the root before its layers and clears ``.grad`` of the root's parameters
  recursively, so a layer still gathered then (a split-backward schedule keeps them gathered
  after the shape pass's forward) also loses the unreduced gradient an earlier micro-step left
  on its unsharded parameter: both kinds are set aside around the step.
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

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from hf_tp.compat.torch_fsdp import internals_present, param_groups, root_post_backward, unsharded_params


def fsdp_roots(models: list[nn.Module]) -> list[FSDPModule]:
    """The stages' FSDP2 roots (none without dp), checked to expose the FSDP2 internals this module
    drives (torch 2.13's: a torch that renamed them is refused here, on every rank alike)."""
    roots = [m for m in models if isinstance(m, FSDPModule)]
    for root in roots:
        state = fully_shard.state(root)
        units = [fully_shard.state(m) for m in root.modules() if isinstance(m, FSDPModule)]
        if not internals_present(state, units):
            raise RuntimeError(
                f"--pp with FSDP2 (dp > 1) drives FSDP2's internals as torch 2.13 has them; torch {torch.__version__} "
                "lacks them: install torch 2.13 or train with --pp 1"
            )
    return roots


def keep_gathered(roots: list[FSDPModule]) -> None:
    """Every unit of ``roots`` keeps its gathered weights after its forward (set once, at build)."""
    for root in roots:
        root.set_reshard_after_forward(False)


def hold_gradients(roots: list[FSDPModule], split_backward: bool) -> list[Held]:
    """Before a schedule's step: set aside the gradients the stages' parameters already hold (the
    earlier micro-steps': reduced ones on the sharded parameters, unreduced ones on the unsharded;
    the schedule's shape pass would drop either), and let each root's units accumulate gradients
    unreduced (a ``split_backward`` schedule's also keep their gathered weights after backward).
    Returns, per root, whether it was set to reduce this micro-step (the caller's
    gradient-accumulation choice) and what was set aside."""
    held = []
    for root in roots:
        params = [fp for g in _groups(root) for fp in g.fsdp_params]
        sync = all(g.reduce_grads for g in _groups(root))
        unsharded = unsharded_params(params)
        held.append(Held(sync, _take_grads([fp.sharded_param for fp in params]), _take_grads(unsharded)))
        if split_backward:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)
    return held


def release_gradients(roots: list[FSDPModule], held: list[Held]) -> None:
    """After the step: the unreduced gradients set aside are added to this step's, then FSDP2's
    post-backward of every unit runs by hand (the reduce-scatter where the root was set to reduce,
    the reshard) and its root's end-of-backward callback; then the reduced gradients set aside are
    added back."""
    for root, kept in zip(roots, held, strict=True):
        _add_grads(kept.unsharded)
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(kept.sync)
        for group in _groups(root):
            group.post_backward()
        root_post_backward(fully_shard.state(root))
        _add_grads(kept.sharded)


@dataclass
class Held:
    """One root's state across a schedule's step (:func:`hold_gradients`)."""

    sync: bool  # reduce this micro-step's gradients after the step
    sharded: list[tuple[nn.Parameter, torch.Tensor]]  # reduced gradients of earlier micro-steps
    unsharded: list[tuple[nn.Parameter, torch.Tensor]]  # unreduced ones (FSDP2's accumulation without sync)


def _take_grads(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The gradients ``params`` hold, each parameter's ``.grad`` then cleared."""
    taken = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in taken:
        p.grad = None
    return taken


def _add_grads(taken: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Give back gradients :func:`_take_grads` took, summed with any the parameters hold now."""
    for param, grad in taken:
        param.grad = grad if param.grad is None else grad + param.grad


def _groups(root: FSDPModule) -> list:
    """The FSDP2 parameter groups of every unit under ``root`` (each once; read from the modules,
    which FSDP2's root state lists only after its lazy init, at the first forward)."""
    states = {id(s): s for m in root.modules() if isinstance(m, FSDPModule) for s in [fully_shard.state(m)]}
    return [g for s in states.values() for g in param_groups(s)]


# FSDP2's warning when a wrapped module's forward returns a view (torch 2.13: _fsdp_state.py).
STAGE_VIEW = r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor\. An in-place op on this view"


@contextlib.contextmanager
def quiet_stage_views() -> Iterator[None]:
    """Exactly FSDP2's warning that a stage returned a view, silenced over a pipeline step: a
    stage's output (its hidden states, their cp tokens, its logits) is a view that the schedule
    only sends on or takes the loss of (a V-shaped schedule, which frees it in place, gets a copy:
    :class:`hf_tp.pipeline.schedules.StageModule`), so no pre-backward hook is skipped: every
    gradient equals plain HF's at pp2 with cp2, dp2, HSDP and interleaved stages
    (tests/e2e/test_pipeline_torchrun.py)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=STAGE_VIEW, category=UserWarning)
        yield
