"""The ("dp", "tp") device mesh: building it and reading a user's mesh back."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(tp: int, dp: int = 1, device_type: str | None = None) -> DeviceMesh:
    """A 2-D mesh named ``("dp", "tp")`` over the whole world; tp ranks are adjacent (fast links).

    The process group must already be initialised (torchrun, accelerate launch, or
    ``dist.init_process_group``). Raises ``ValueError`` if ``tp * dp`` is not the world size.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be positive integers, got tp={tp}, dp={dp}")
    if not dist.is_initialized():
        raise ValueError(
            "build_mesh needs an initialised process group: start the ranks with `hf-tp train`, "
            "`torchrun`, `accelerate launch` or accelerate.notebook_launcher"
        )
    world = dist.get_world_size()
    if tp * dp != world:
        raise ValueError(f"world size ({world}) must equal tp*dp ({tp}*{dp}={tp * dp})")
    return init_device_mesh(device_type or default_device_type(), (dp, tp), mesh_dim_names=("dp", "tp"))


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh]:
    """Return ``(dp_mesh or None, tp_mesh)`` of a 1-D (tp) or 2-D ``("dp", "tp")`` mesh.

    Checks are local (no collectives), so every rank raises the same error.
    """
    names = mesh.mesh_dim_names
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh covers {mesh.size()} ranks but the world size is {dist.get_world_size()}; "
            "build it over all ranks, e.g. hf_tp.build_mesh(tp=..., dp=...)"
        )
    if mesh.ndim == 1:
        if names not in (None, ("tp",)):
            raise ValueError(
                f"a 1-D mesh is used for tensor parallelism and must be named 'tp' (or unnamed), "
                f"got mesh_dim_names={names}"
            )
        return None, mesh
    if mesh.ndim == 2 and names is not None and set(names) == {"dp", "tp"}:
        return mesh["dp"], mesh["tp"]
    raise ValueError(
        f"the mesh must be 1-D (tp) or 2-D with dims named ('dp', 'tp'), got ndim={mesh.ndim}, "
        f"mesh_dim_names={names}; build it with hf_tp.build_mesh(tp=..., dp=...)"
    )
