"""Decoder layers that flatten their sequence-parallel tokens around an MLP they run themselves.

OPT's layer does ``hidden_states.reshape(-1, hidden)`` on the residual, runs its norm, ``fc1`` and
``fc2`` on the flattened tokens and ``.view``s the sum back to ``(batch, seq, hidden)``. On the
sequence-sharded residual DTensor flattens without communication (a strided shard of the
tokens: the rank's local rows are its shard reshaped), but it cannot view that layout back into
``Shard(1)``: it all-gathers the residual, and every layer after it runs on the whole sequence.
The rank's rows are exactly its ``Shard(1)`` shard reshaped, so a torch-function mode active
during the layer does both reshapes on the local tensors and re-wraps them (``to_local`` /
``from_local`` carry the gradients back with no communication either).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from hf_tp.parallel.one_token import mode_during_forward

_RESHAPES = (torch.Tensor.reshape, torch.Tensor.view)


def keep_token_reshapes_local(layer: nn.Module) -> None:
    """Run ``layer`` under :class:`_LocalTokenReshapes` (see the module docstring)."""
    mode_during_forward(layer, lambda args, kwargs: _LocalTokenReshapes())


class _LocalTokenReshapes(TorchFunctionMode):
    """Flattening a ``Shard(1)`` (batch, seq, hidden) DTensor to (tokens, hidden), and viewing
    that back, done on the local tensors; the flattened layout is the one DTensor gives itself."""

    def __init__(self) -> None:
        super().__init__()
        self.flat: tuple | None = None  # (placements, batch, seq) of this layer's flattened tokens

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RESHAPES and args and isinstance(args[0], DTensor) and not kwargs:
            shape = tuple(args[1]) if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
            out = self._local(func, args[0], tuple(shape))
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _local(self, func, x: DTensor, shape: tuple) -> DTensor | None:
        mesh, hidden = x.device_mesh, x.shape[-1]
        if x.ndim == 3 and tuple(x.placements) == (Shard(1),) and x.shape[1] > 1 and shape in ((-1, hidden),):
            flat = func(x, *shape)  # DTensor's own layout for it (no communication), its values unused
            self.flat = (tuple(flat.placements), x.shape[0], x.shape[1])
            local = x.to_local().reshape(-1, hidden)
            return DTensor.from_local(local, mesh, flat.placements, shape=flat.shape, stride=flat.stride())
        if self.flat and x.ndim == 2 and tuple(x.placements) == self.flat[0] and math.prod(shape) == x.numel():
            b, s = self.flat[1:]
            if tuple(shape) == (b, s, hidden):
                local = x.to_local().view(b, -1, hidden)
                size = torch.Size((b, s, hidden))
                return DTensor.from_local(local, mesh, [Shard(1)], shape=size, stride=(s * hidden, hidden, 1))
        return None
