"""torch.distributed's private names hf_tp reaches: meshes, process groups, collectives, DCP, elastic.

Each function is what hf_tp did inline before, moved here; the private modules are imported when
a function is first called, so importing this module reaches none of them (the probes do).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hf_tp.compat.reaches import reaches

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Store
    from torch.distributed.device_mesh import DeviceMesh

MESH = "torch.distributed.device_mesh:DeviceMesh"
C10D = "torch.distributed.distributed_c10d"
FUNCOL = "torch.distributed._functional_collectives"


@reaches(f"{MESH}._get_root_mesh")
def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``mesh`` itself if it is one); torch has no public API."""
    return mesh._get_root_mesh()


@reaches(f"{MESH}._flatten")
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims flattened into one dim called ``name``, registered on the root mesh (so that
    ``root[name]`` slices it); torch has no public API."""
    return mesh._flatten(name)


@reaches(f"{C10D}:_get_default_group")
def default_group() -> ProcessGroup:
    """The default (world) process group object of this process."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()


@reaches("torch._C._distributed_c10d:_resolve_process_group")
def resolve_process_group(name: str) -> ProcessGroup:
    """The process group registered under ``name`` (raises if there is none)."""
    from torch._C._distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@reaches(f"{C10D}:_abort_process_group")
def abort_process_group() -> None:
    """Abort every process group of this rank at once (destroy may wait for collectives in flight)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


@reaches(f"{C10D}:_set_pg_timeout", f"{C10D}:_world.pg_map")
def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the world, the mesh dims') times out after ``seconds``."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        _set_pg_timeout(timedelta(seconds=seconds), group)


@reaches(f"{C10D}:_get_default_store")
def default_store() -> Store:
    """The store of the default process group (raises where there is none)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


@reaches("torch.distributed.elastic.multiprocessing.api:_terminate_process_handler")
def terminate_process_handler(signum: int, frame: Any) -> None:
    """What torch elastic's launcher does on a stop signal (raise to stop its workers)."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    _terminate_process_handler(signum, frame)


@reaches(f"{FUNCOL}:all_to_all_single_autograd")
def all_to_all_autograd(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
    """The differentiable all-to-all (backward: the reverse all-to-all), as an async tensor."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, out_sizes, in_sizes, group)


@reaches(f"{FUNCOL}:wait_tensor")
def wait_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a functional collective's output) once its collective is done."""
    from torch.distributed._functional_collectives import wait_tensor as wait

    return wait(x)


def _gather_name() -> str | None:
    """A probe: torch names its autograd all-gather one of two ways (2.13 renamed it)."""
    from torch.distributed import _functional_collectives as funcol

    names = ("all_gather_single_autograd", "all_gather_tensor_autograd")
    return None if any(hasattr(funcol, n) for n in names) else f"{FUNCOL}.{names[0]} is gone"


@reaches(FUNCOL, check=_gather_name)
def autograd_all_gather() -> Callable[..., torch.Tensor]:
    """torch's differentiable all-gather (backward: reduce-scatter), ``f(x, gather_dim=, group=)``:
    torch 2.13 renamed it ``all_gather_single_autograd``; before, only ``all_gather_tensor_autograd``."""
    from torch.distributed import _functional_collectives as funcol

    return getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@reaches("torch.distributed.tensor._utils:compute_local_shape_and_global_offset")
def local_shape_and_offset(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, global offset) of the shard this rank holds of the DTensor ``param``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


@reaches("torch.distributed.checkpoint._traverse:set_element")
def set_element(state_dict: dict, path: Any, value: Any) -> None:
    """Put ``value`` at DCP's object path ``path`` of a nested ``state_dict`` (DCP's flattening undone)."""
    from torch.distributed.checkpoint._traverse import set_element as put

    put(state_dict, path, value)


@reaches("torch.distributed.checkpoint:FileSystemReader._get_metadata_path")
def metadata_path(reader: Any, rank: int | None) -> Any:
    """The path of the ``.metadata`` file a DCP ``FileSystemReader`` reads for ``rank``."""
    return reader._get_metadata_path(rank)
