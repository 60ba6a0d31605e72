"""FSDP2 (``fully_shard``) on the dp mesh dim, per decoder layer and the root."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hf_tp.adapters.registry import Adapter


def apply_fsdp(
    model: nn.Module,
    adapter: Adapter,
    dp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Shard parameters over ``dp_mesh``: one FSDP unit per decoder layer, the rest in the root.

    Run after tensor parallelism; FSDP2 then builds 2-D (dp, tp) parameters from the TP DTensors.
    ``ignored_params`` (expert-parallel weights) stay as they are.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    # A module kept in another dtype (a router transformers builds in fp32 inside a bf16 or fp64
    # model) runs in its own dtype, as in the model.
    own_dtype = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=False)
    layers = model.get_submodule(adapter.layers_path)
    for layer in layers:
        for module in odd_dtype_modules(layer, ignored_params or set()):
            fully_shard(
                module,
                mesh=dp_mesh,
                mp_policy=own_dtype,
                reshard_after_forward=reshard_after_forward,
                ignored_params=ignored_params,
            )
        fully_shard(
            layer,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root unit is needed in backward right away, so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False, ignored_params=ignored_params)


def odd_dtype_modules(layer: nn.Module, ignored: set[nn.Parameter]) -> list[nn.Module]:
    """The submodules whose own trainable parameters have another dtype than most of the layer's.

    FSDP2 needs one parameter dtype per unit ("FSDP expects uniform original parameter dtype"),
    so each of these becomes a unit of its own inside the layer's."""
    owned = [
        (module, p)
        for module in layer.modules()
        for p in module.parameters(recurse=False)
        if p.requires_grad and p not in ignored
    ]
    sizes: Counter[torch.dtype] = Counter()
    for _, p in owned:
        sizes[p.dtype] += p.numel()
    if len(sizes) < 2:
        return []
    main = sizes.most_common(1)[0][0]
    return list({id(m): m for m, p in owned if p.dtype != main}.values())
