"""FSDP2 (``fully_shard``) on the dp mesh dim, per decoder layer and the root."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hf_tp.adapters.registry import Adapter
from hf_tp.compat.transformers_private import keep_output_capture
from hf_tp.core.record import facts_of


def apply_fsdp(
    model: nn.Module,
    adapter: Adapter,
    dp_mesh: DeviceMesh,
    *,
    shard_mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
    averaged: set[nn.Parameter] | None = None,
    fused: bool = False,
) -> None:
    """Shard parameters over ``dp_mesh``: one FSDP unit per decoder layer, the rest in the root.

    Run after tensor parallelism; FSDP2 then builds 2-D (dp, tp) parameters from the TP DTensors.
    Expert-parallel experts are their own units first (:func:`shard_experts_over_dp`), and so is
    each of a multimodal wrapper's passenger modules (a vision tower text data never runs stays
    sharded: the root unit would hold it gathered for the whole step).
    ``ignored_params`` (expert-parallel weights, :func:`odd_dtype_params`) stay as they are;
    those of them in ``averaged`` get their gradients averaged over dp here, as FSDP2 averages
    the others (``fused``: tp-``Partial`` ones are left to :mod:`hf_tp.parallel.partial_grads`,
    which reduces them over dp and tp at once). ``shard_mesh``: the mesh ``fully_shard`` takes
    when it is not ``dp_mesh``, a 2-D ``(dp_replicate, dp_shard)`` one for HSDP (FSDP2 then
    reduce-scatters over dp_shard and all-reduces over dp_replicate, still the mean over dp).
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    mesh = shard_mesh or dp_mesh
    layers = model.get_submodule(adapter.layers_path)
    for p in averaged or set():
        p.register_hook(_mean_over(dp_mesh, fused))
    shard_experts_over_dp(model, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    modules = dict(model.named_modules())
    for path in adapter.passengers:  # a wrapper's vision tower, projector: own units, gathered only if they run
        if path in modules:
            fully_shard(modules[path], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    for layer in layers:
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root unit is needed in backward right away, so it is never resharded after forward.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, ignored_params=ignored_params)
    keep_output_capture(model)  # fully_shard re-classes the modules it wraps


def shard_experts_over_dp(
    model: nn.Module, *, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool = True
) -> list[nn.Module]:
    """FSDP2 on each experts module expert parallelism placed on a ``(dp_out, ep, tp)`` mesh with
    ``dp_out`` > 1 (:mod:`hf_tp.moe.expert_parallel`): its weights, gradients and optimizer
    state are sharded over ``dp_out`` too (``Shard(0)`` of each rank's experts, strided under the
    ep split), so per-rank expert state falls as 1/dp whatever ep is, and the all-gathers and
    reduce-scatters stay inside the dp_out group. A gradient is the sum over all dp ranks' tokens
    divided by dp, as for every other weight. Returns the modules sharded."""
    done = []
    for module in model.modules():
        shard = getattr(facts_of(module), "experts", None)
        mesh = None if shard is None else shard.mesh
        if mesh is None or mesh["dp_out"].size() == 1:
            continue  # at ep = dp: expert_parallel's own gradient hook averages over dp
        fully_shard(
            module,
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(shard="dp_out"),
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
        )
        module.set_gradient_divide_factor(float(mesh["dp_out"].size() * mesh["ep"].size()))
        if dist.get_backend(mesh["dp_out"].get_group()) != "nccl":  # PREMUL_SUM is NCCL's: sum, then scale
            module.set_force_sum_reduction_for_comms(True)
        done.append(module)
    return done


def odd_dtype_params(model: nn.Module, adapter: Adapter) -> set[nn.Parameter]:
    """Trainable parameters of modules kept in another dtype than most of their decoder layer's
    (a router transformers builds in fp32 in a bf16 or fp64 model).

    FSDP2 needs one parameter dtype per unit ("FSDP expects uniform original parameter dtype"),
    and these modules must keep theirs. They are small: they stay whole on every dp rank, outside
    FSDP2. (A unit of their own would unshard them only at their own forward, after a MoE
    region has read their weights.)"""
    layers = model.get_submodule(adapter.layers_path)
    units = [layers] + [m for n, m in model.named_modules() if n in adapter.passengers]  # FSDP units of their own
    inside = {id(m) for unit in units for m in unit.modules()}
    # the root unit's own modules too (DeepSeek-V4's fp32 hyper-connection head beside a float64 embedding)
    root = [[m for m in model.modules() if id(m) not in inside]]
    out: set[nn.Parameter] = set()
    for modules in [list(layer.modules()) for layer in layers] + root:
        owned = [(m, p) for m in modules for p in m.parameters(recurse=False) if p.requires_grad]
        sizes: Counter[torch.dtype] = Counter()
        for _, p in owned:
            sizes[p.dtype] += p.numel()
        if len(sizes) > 1:
            main = sizes.most_common(1)[0][0]
            odd = {id(m) for m, p in owned if p.dtype != main}
            out |= {p for m, p in owned if id(m) in odd}
    return out


def _mean_over(dp_mesh: DeviceMesh, fused: bool):
    """Gradient hook: the mean over the dp ranks (FSDP2's reduction, for a parameter outside it)."""
    group, size = dp_mesh.get_group(), dp_mesh.size()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if fused and isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            return grad  # the fused reduction sums it over tp and averages it over dp
        local = (grad.to_local() if isinstance(grad, DTensor) else grad) / size
        dist.all_reduce(local, group=group)
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook
