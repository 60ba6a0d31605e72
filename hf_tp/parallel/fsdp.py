"""FSDP2 (``fully_shard``) on the dp mesh dim, per decoder layer and the root."""

from __future__ import annotations

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
    layers = model.get_submodule(adapter.layers_path)
    for layer in layers:
        fully_shard(
            layer,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root unit is needed in backward right away, so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False, ignored_params=ignored_params)
