"""The mesh ``hf-tp estimate`` simulates (the one :func:`hf_tp.build_mesh` makes) and its process
groups by name -> (mesh dim, size), which the comm counter files each collective under."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hf_tp.estimate.moe import ep_groups
from hf_tp.parallel.mesh import HSDP_DIMS


def expert_groups(experts, groups: dict[str, tuple[str, int]]) -> dict[tuple[str, str], tuple[str, int]]:
    """Add the ep mesh's groups to ``groups`` (its tp dim is the tp ranks again) and return the
    all-to-alls to count as ep, named so even where the ep ranks are all the dp ranks (one group)."""
    all_to_all = {}
    for name, dim in ep_groups(experts).items():
        groups.setdefault(name, dim)
        if dim[0] == "ep":
            all_to_all[(name, "all_to_all")] = dim
    return all_to_all


def functional_groups(mesh: DeviceMesh, cp: int) -> dict[str, tuple[str, int]]:
    """The cp group for the comm counter's functional collectives: cp's K/V gathers are functional,
    FSDP2's over dp x cp are c10d ones, and at dp = 1 the two share one process group."""
    return {mesh["cp"].get_group().group_name: ("cp", cp)} if cp > 1 else {}


def mesh_and_groups(tp: int, cp: int, dp: int, dp_replicate: int) -> tuple[DeviceMesh, dict[str, tuple[str, int]]]:
    """:func:`_layout_mesh` and, as "world", the group of the gradient norm's one all-reduce over
    every rank (:func:`hf_tp.parallel.grad.clip_grad_norm`)."""
    mesh, groups = _layout_mesh(tp, cp, dp, dp_replicate)
    groups.setdefault(dist.group.WORLD.group_name, ("world", dist.get_world_size()))
    return mesh, groups


def _layout_mesh(tp: int, cp: int, dp: int, dp_replicate: int) -> tuple[DeviceMesh, dict[str, tuple[str, int]]]:
    """The mesh hf_tp.build_mesh makes, and its groups by name -> (dim, size) for the comm counter
    (sliced outside fake mode). With cp, FSDP2 runs on dp x cp: its traffic is counted as "dp".
    With HSDP, FSDP2's gathers and reduce-scatters over the shard group count as "dp", its
    gradient all-reduce across replicas as "dp_replicate", and collectives over all dp ranks
    (e.g. a router's gradient kept whole) as "dp_all"."""
    if dp_replicate > 1:
        mesh = init_device_mesh("cpu", (dp_replicate, dp // dp_replicate, tp), mesh_dim_names=HSDP_DIMS)
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        named = {"tp": "tp", "dp_shard": "dp", "dp_replicate": "dp_replicate"}
        groups = {mesh[d].get_group().group_name: (name, mesh[d].size()) for d, name in named.items()}
        groups.setdefault(flat.get_group().group_name, ("dp_all", flat.size()))
        return mesh, groups
    if cp == 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return mesh, {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in ("dp", "tp")}
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    groups = {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in ("cp", "tp")}
    groups[flat.get_group().group_name] = ("dp", flat.size())
    return mesh, groups
