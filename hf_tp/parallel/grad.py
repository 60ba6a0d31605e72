"""Gradient-norm clipping that is exact when parameters live on different device meshes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm`` (0: only measure); return the norm.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when DTensors live on
    different meshes (e.g. 2-D (dp, tp) weights next to dp-only ones). Here the norm is taken per
    mesh, each made global with ``full_tensor()``, and combined, so every rank gets the same
    exact value.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        coef = float(max_norm / (total + 1e-6))
        if coef < 1.0:
            for grads in groups.values():
                for g in grads:
                    g.mul_(coef)
    return total
