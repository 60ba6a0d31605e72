"""Ops whose output size depends on the data, under the estimate's fake tensors.

A fake tensor has no values, so ``nonzero`` (Qwen4-Exp's sparse-attention indexer lists the keys a
query may see with it) cannot know how many elements it returns; torch's fake mode refuses it.
The estimate takes such an op at its upper bound, every element selected (for the indexer: every
visible key), so the step runs with the largest tensors the op can produce: memory and work are
never under-counted for it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class DataDependentBounds(TorchDispatchMode):
    """Run (innermost, just above the fake mode) ``nonzero`` as its upper bound: the indices of
    every element, an uninitialized ``[numel, dim]`` long tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops first
        if func is aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))
