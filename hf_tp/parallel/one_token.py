"""One-token steps in decoder layers that flatten their sequence-parallel tokens themselves.

A layer that calls its own router and experts (Gemma 4's MoE layers) does
``residual.reshape(-1, hidden)``. On the sequence-sharded residual DTensor turns that into a
strided shard of the tokens, each rank keeping its own, with no communication, for any sequence of
two or more tokens. A one-token sequence (each decode step of ``generate``) is refused instead:
DTensor drops a size-1 dim when it plans a view and cannot drop a sharded one ("would remove or
reshape sharded dimension 1"). For such steps only, a torch-function mode active during the layer
all-gathers a tensor with a sharded size-1 dim right before it is reshaped (one token per row: a
few KiB), so the flattened tokens are whole on every rank; the router, norms and experts around
them accept that layout (:class:`hf_tp.styles.PerTokenOnShards`, :class:`hf_tp.moe.expert_styles.MoERegion`).
Longer sequences never enter the mode and pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

_RESHAPES = (torch.Tensor.reshape, torch.Tensor.view, torch.reshape, torch.Tensor.flatten, torch.flatten)


def _sharded_singleton(x: DTensor) -> bool:
    """``x`` is split over a dim of size 1 (all of it on one rank)."""
    return any(
        not p.is_replicate()
        and not p.is_partial()
        and (dim := getattr(p, "dim", None)) is not None
        and x.shape[dim] == 1
        for p in x.placements
    )


class _GatherBeforeReshape(TorchFunctionMode):
    """Reshapes of a DTensor split over a size-1 dim see it whole (all-gathered) instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RESHAPES and args and isinstance(args[0], DTensor) and _sharded_singleton(args[0]):
            x = args[0]
            args = (x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim), *args[1:])
        return func(*args, **kwargs)


def gather_one_token_steps(layer: nn.Module) -> None:
    """Run ``layer``'s one-token steps under :class:`_GatherBeforeReshape` (see the module docstring)."""

    def one_token(args: tuple, kwargs: dict) -> TorchFunctionMode | None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        one = isinstance(hidden, DTensor) and hidden.dim() >= 2 and hidden.shape[1] == 1
        return _GatherBeforeReshape() if one else None

    mode_during_forward(layer, one_token)


def mode_during_forward(layer: nn.Module, make: Callable[[tuple, dict], TorchFunctionMode | None]) -> None:
    """Run each ``layer`` call under the torch-function mode ``make(args, kwargs)`` returns (none: as is)."""
    active: list[TorchFunctionMode] = []

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if (mode := make(args, kwargs)) is not None:
            active.append(mode)
            mode.__enter__()

    def leave(mod: nn.Module, args: tuple, kwargs: dict, output):
        if active:
            active.pop().__exit__(None, None, None)
        return output

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(leave, with_kwargs=True, always_call=True)
