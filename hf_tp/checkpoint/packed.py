"""One layout in every checkpoint for the parameters hf_tp stores as packed halves under tp > 1.

A fused weight that holds two halves along one dim (the experts' ``gate_up_proj``, HF's
``[experts, 2I, hidden]``) is stored under tp > 1 as ``[experts, 2, I, hidden]``, sharded on ``I``
(:func:`hf_tp.moe.expert_styles.stored_shape`): a rank's slice of both halves is two boxes of HF's
layout, which one DTensor placement cannot describe. At tp = 1 the parameter keeps HF's shape. A
checkpoint in the mesh's own layout therefore loaded only on meshes that store it alike (``Size
mismatch between saved torch.Size([16, 2, 32, 512]) and current torch.Size([16, 64, 512])``).

Every checkpoint now holds such parameters, and their optimizer moments, in the packed layout,
whatever the mesh: at tp = 1 the state dict handed to DCP holds views of the live tensors in that
shape (the same numbers in the same order; FSDP2 and ep shard the experts dim, which the view
keeps), so DCP writes from them and reads into them in place, and the live state dict goes on to
``set_*_state_dict`` unchanged. DCP then reshards between any tp, dp and ep.

Where the mesh shards the packed dim itself (FSDP2 at tp = 1 shards dim 0 of a 2-D packed
shared-expert ``gate_up_proj``, whose rows are ``[gate; up]``), a rank's rows can straddle the two
halves, which no placement of the packed shape describes. Such a tensor is gathered over the mesh
dims that shard it into a copy in the packed layout; a load reads into the copy and
:func:`write_back` puts the rank's shard of it back into the live tensor.

Checkpoints written before (HF's layout at tp = 1; tp > 1 ones already hold the packed layout)
still load where the parameter has HF's shape; at tp > 1 they are refused with one line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor, Replicate

from hf_tp.moe.expert_styles import Role, packed_params, stored_shape

Copies = list[tuple[DTensor, DTensor, int]]  # (packed copy, live tensor, the packed dim)


def checkpoint_layout(
    state: dict[str, Any],
    model: nn.Module,
    saved: Metadata | None = None,
    where: Path | None = None,
    copies: Copies | None = None,
) -> dict[str, Any]:
    """``state`` (``{"model": ..., "optim": ...}`` of :func:`hf_tp.checkpoint.dcp._train_state`) as
    the checkpoint holds it: packed parameters and their tensor state as packed-layout views of
    the live tensors. Every container not rebuilt here is shared with ``state``, so what DCP loads
    into it (tensors in place, the optimizer's param groups by value) reaches ``state``. ``saved``:
    the metadata of the checkpoint about to be loaded (its layout decides for older checkpoints).
    ``copies`` collects (packed copy, live tensor) of what could not be a view, for :func:`write_back`."""
    packed = packed_params(model)
    if not packed:
        return state
    copies = [] if copies is None else copies
    out = dict(state)
    out["model"] = {k: _stored(f"model.{k}", v, packed.get(k), saved, where, copies) for k, v in state["model"].items()}
    optim = state.get("optim")
    if isinstance(optim, dict) and isinstance(optim.get("state"), dict):
        per_param = {}
        for name, values in optim["state"].items():
            if name in packed and isinstance(values, dict):
                values = {
                    m: _stored(f"optim.state.{name}.{m}", v, packed[name], saved, where, copies)
                    for m, v in values.items()
                }
            per_param[name] = values
        out["optim"] = {**optim, "state": per_param}
    return out


def _stored(
    key: str,
    value: Any,
    packed: tuple[int, tuple[int, ...]] | None,
    saved: Metadata | None,
    where: Path | None,
    copies: Copies,
) -> Any:
    """``value`` in the packed layout when it is a tensor of the parameter's HF shape (tp = 1),
    else as it is (already packed at tp > 1; a scalar ``step``; anything not packed). ``packed``:
    (the dim of the two halves, the HF shape) of the parameter, None when it is not packed."""
    if packed is None or not torch.is_tensor(value):
        return value
    dim, hf_shape = packed
    entry = saved.state_dict_metadata.get(key) if saved is not None else None
    old = tuple(getattr(entry, "size", ())) == hf_shape  # written in HF's layout (at tp = 1, before)
    if tuple(value.shape) != hf_shape:
        if old and value.dim() == len(hf_shape) + 1:
            raise ValueError(
                f"checkpoint {where}: {key} is stored in HF's layout {hf_shape} (a tp = 1 checkpoint of an hf_tp "
                f"release before checkpoints had one layout), which a tp > 1 mesh cannot read into its packed "
                f"halves {tuple(value.shape)}: resume it once at tp 1 and save, then any mesh loads that checkpoint"
            )
        return value
    if old:
        return value
    if isinstance(value, DTensor) and _sharded_from(value, dim):
        copy = split_view(value.detach().redistribute(value.device_mesh, _unsharded_from(value, dim)), dim)
        copies.append((copy, value, dim))
        return copy
    return split_view(value, dim)


def write_back(copies: Copies) -> None:
    """Put each rank's shard of the packed copies a load read into back into their live tensors."""
    for copy, live, dim in copies:
        local = copy.to_local().flatten(dim, dim + 1)
        whole = DTensor.from_local(
            local, copy.device_mesh, copy.placements, run_check=False, shape=live.shape, stride=live.stride()
        )
        with torch.no_grad():
            live.detach().to_local().copy_(whole.redistribute(live.device_mesh, live.placements).to_local())


def _sharded_from(tensor: DTensor, dim: int) -> bool:
    return any(getattr(p, "dim", -1) >= dim for p in tensor.placements)


def _unsharded_from(tensor: DTensor, dim: int) -> list:
    """``tensor``'s placements with every shard at or after ``dim`` replaced by a replica."""
    return [Replicate() if getattr(p, "dim", -1) >= dim else p for p in tensor.placements]


def split_view(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """A view of ``tensor`` with ``dim`` split in ``(2, n / 2)``; a DTensor stays one, with the
    same placements (which must shard only dims before ``dim``: FSDP2 and ep shard dim 0)."""
    if tensor.shape[dim] % 2:
        raise ValueError(f"a packed tensor of shape {tuple(tensor.shape)} has an odd dim {dim}")
    shape = _split(tuple(tensor.shape), dim)
    if not isinstance(tensor, DTensor):
        return tensor.detach().view(shape)
    for p in tensor.placements:
        if getattr(p, "dim", -1) >= dim:
            raise ValueError(
                f"cannot view {tuple(tensor.shape)} placed {tensor.placements} in the packed layout: it is "
                f"sharded on dim {p.dim}, at or after the packed dim {dim}"
            )
    local = tensor.detach().to_local()
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local.view(_split(tuple(local.shape), dim)),
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def _split(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return stored_shape(shape, Role("shard", dim, packed=True))
