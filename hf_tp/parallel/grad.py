"""Gradient-norm clipping that is exact when parameters live on different device meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm`` (0: only measure); return the norm.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on
    different meshes (e.g. 2-D (dp, tp) weights next to dp-only ones), and reduces a 2-D norm one
    mesh dim after the other. Here each rank sums the squares of its local shards, weighing each
    by 1 / (number of ranks holding a copy of it), and one all-reduce gives every rank the same
    exact norm.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = _norm_in_one_all_reduce(grads)
    if total is None:
        total = _norm_per_mesh(grads)
    if max_norm > 0:
        coef = float(max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


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


def reduce_partial_grads(parameters: Iterable[torch.nn.Parameter]) -> int:
    """Turn every ``Partial`` DTensor gradient into ``Replicate`` with one all-reduce per mesh group.

    Under sequence parallelism the norm weights are replicated but each rank sees only its sequence
    shard, so their gradients stay ``Partial(sum)``. Left alone, every later use (the grad norm,
    each AdamW state update) redistributes each of them separately; here they are flattened into
    one buffer and summed once. Returns the number of collectives issued.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in parameters:
        g = p.grad
        partial = [pl for pl in g.placements if isinstance(pl, Partial)] if isinstance(g, DTensor) else []
        if partial and all(pl.reduce_op == "sum" for pl in partial):
            groups.setdefault((g.device_mesh, tuple(g.placements), g.dtype), []).append(p)
    issued = 0
    for (mesh, placements, _), params in groups.items():
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if isinstance(pl, Partial):
                torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=mesh.get_group(dim))
                issued += 1
        new_placements = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in placements)
        offset = 0
        for p, t in zip(params, locals_, strict=True):
            n = t.numel()
            local = flat[offset : offset + n].view_as(t)
            offset += n
            p.grad = DTensor.from_local(local, mesh, new_placements, shape=p.grad.shape, stride=p.grad.stride())
    return issued
