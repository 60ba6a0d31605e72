"""FSDP2 inside the stages of a schedule that splits the backward (``zbv``, ``dualpipev``).

Such a schedule runs each micro-batch's backward in two parts: the input gradients first (sent on
to the previous stage), the weight gradients later, from the same autograd graph. FSDP2's own
hooks fire with the first part, before any weight gradient exists, and would reshard the layers
(so the later part finds other Parameters: torch's ``KeyError: <AccumulateGrad ...>``) and reduce
nothing. torch's pipelining handles this only when a stage module is itself the FSDP2 root; a
hf_tp stage wraps its HF model, which is. So, as torch does for its own roots: the stages' units
keep their gathered weights through the step (no reshard after forward or backward), gradients
accumulate unreduced, and after the schedule's step each root's units run FSDP2's post-backward
by hand (the reduce-scatter, on the micro-step that syncs, then the reshard).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def fsdp_roots(models: list[nn.Module]) -> list[FSDPModule]:
    """The stages' FSDP2 roots (none without dp)."""
    return [m for m in models if isinstance(m, FSDPModule)]


def keep_gathered(roots: list[FSDPModule]) -> None:
    """Every unit of ``roots`` keeps its gathered weights after its forward (set once, at build)."""
    for root in roots:
        root.set_reshard_after_forward(False)


def hold_gradients(roots: list[FSDPModule]) -> list[bool]:
    """Before a split-backward step: each root's units keep their gathered weights after backward
    and accumulate gradients unreduced; returns whether each root was set to reduce this step."""
    syncs = [all(g.reduce_grads for s in _states(r) for g in s._fsdp_param_groups) for r in roots]
    for root in roots:
        root.set_is_last_backward(False)
        root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)
    return syncs


def release_gradients(roots: list[FSDPModule], syncs: list[bool]) -> None:
    """After the step: FSDP2's post-backward of every unit by hand (reduce-scatter where ``syncs``
    says, reshard), then its root's end-of-backward callback."""
    for root, sync in zip(roots, syncs, strict=True):
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(sync)
        for state in _states(root):
            for group in state._fsdp_param_groups:
                group.post_backward()
        fully_shard.state(root)._root_post_backward_final_callback()


def _states(root: FSDPModule) -> list:
    return list(fully_shard.state(root)._state_ctx.all_states)
