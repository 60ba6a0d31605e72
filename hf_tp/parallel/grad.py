"""Gradient-norm clipping that is exact when parameters live on different device meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    stages: dist.ProcessGroup | None = None,
    uncounted: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm`` (0: only measure); return the norm.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on
    different meshes (e.g. 2-D (dp, tp) weights next to dp-only ones), and reduces a 2-D norm one
    mesh dim after the other. Here each rank sums the squares of its local shards, weighing each
    by 1 / (number of ranks holding a copy of it), and one all-reduce gives every rank the same
    exact norm. ``stages``: the pp group of a pipeline run, whose ranks hold other stages'
    parameters: each stage's norm is found over its own mesh, then the squares summed over it.
    ``uncounted``: parameters clipped alike but left out of the norm (the last pipeline stage's
    copy of a tied weight: the first stage's copy, with the same gradient, counts for both).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if stages is not None:
        total = _over_stages(_norm_per_mesh(grads) if grads else torch.tensor(0.0), grads, stages)
    elif not grads:
        return torch.tensor(0.0)
    else:
        total = _norm_in_one_all_reduce(grads)
        if total is None:
            total = _norm_per_mesh(grads)
    if max_norm > 0:
        coef = float(max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in grads + [p.grad for p in uncounted if p.grad is not None]:
                g.mul_(coef)
    return total


def _over_stages(norm: torch.Tensor, grads: list[torch.Tensor], stages: dist.ProcessGroup) -> torch.Tensor:
    """The L2 norm over every pipeline stage from each stage's norm (one all-reduce over ``stages``)."""
    device = grads[0].device if grads else torch.device("cpu")
    square = (norm.double() ** 2).to(device)
    dist.all_reduce(square, op=dist.ReduceOp.SUM, group=stages)
    return square.sqrt().float().cpu()


def _norm_in_one_all_reduce(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """None unless every DTensor lives on a mesh of all ranks without ``Partial`` placements."""
    if not dist.is_initialized() or not any(isinstance(g, DTensor) for g in grads):
        return None
    world = dist.get_world_size()
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        copies = world  # a plain tensor: the same on every rank
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            if mesh.size() != world or any(pl.is_partial() for pl in g.placements):
                return None
            copies = math.prod(n for n, pl in zip(mesh.shape, g.placements, strict=True) if pl.is_replicate())
            g = g.to_local()
        by_copies.setdefault(copies, []).append(g)
    squares = [torch.nn.utils.get_total_norm(ts, norm_type=2.0).float() ** 2 / c for c, ts in by_copies.items()]
    total = torch.stack(squares).sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.sqrt().cpu()


def _norm_per_mesh(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm per mesh made global with ``full_tensor()``, then combined (any meshes)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float().cpu())
    return torch.linalg.vector_norm(torch.stack(norms))
