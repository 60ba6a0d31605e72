"""The ("dp", "tp") device mesh (("dp", "cp", "tp") with context parallelism, ("dp_replicate",
"dp_shard", "tp") with HSDP): building it and reading a user's mesh back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.compat.torch_distributed import flatten_mesh, root_mesh
from hf_tp.core.dims import HSDP_DIMS, ParallelDims


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"  # (ParallelDims.build_mesh's default too)


def build_mesh(
    tp: int, dp: int = 1, device_type: str | None = None, cp: int = 1, dp_replicate: int = 1, pp: int = 1
) -> DeviceMesh:
    """A mesh named ``("dp", "tp")`` over the whole world, ``("dp", "cp", "tp")`` when ``cp`` > 1,
    ``("dp_replicate", "dp_shard", "tp")`` when ``dp_replicate`` > 1 (HSDP: dp = dp_replicate
    replicas x dp / dp_replicate ranks sharding the weights, a ``"dp"`` dim flattened from both);
    tp ranks are adjacent (fast links), then cp or dp_shard.

    The process group must already be initialised (torchrun, accelerate launch, or
    ``dist.init_process_group``). Raises ``ValueError`` if ``dp * cp * tp`` is not the world size.
    With ``cp`` > 1 every rank of a cp x tp group is given the same full rows (a dp rank's
    rows); the model keeps each rank's share of their tokens (:mod:`hf_tp.context.token_share`).
    ``pp`` > 1 adds an outermost ``"pp"`` dim (pipeline stages; :mod:`hf_tp.pipeline.schedules`):
    the rest of the mesh, ``mesh[stage_dims(mesh)]``, is each stage's as above. The same as
    ``ParallelDims(tp=..., dp=..., ...).build_mesh(device_type)``.
    """
    return ParallelDims(tp=tp, dp=dp, cp=cp, dp_replicate=dp_replicate, pp=pp).build_mesh(device_type)


@dataclass(frozen=True)
class MeshSlices:
    """The named slices of one mesh (a whole mesh or a pipeline stage's), read once: ``tp``; ``dp``,
    the mesh FSDP2 shards over (dp x cp flattened with context parallelism, both HSDP dims
    flattened), None on a 1-D mesh; ``cp`` (None without context parallelism); ``fsdp``, HSDP's
    2-D ``("dp_replicate", "dp_shard")`` mesh (else None); ``dp_replicate``, its replicas (1 without);
    ``rows``, the ranks that read their own rows (dp without cp, :func:`dp_mesh_of`; None on a 1-D mesh)."""

    mesh: DeviceMesh
    tp: DeviceMesh
    dp: DeviceMesh | None
    cp: DeviceMesh | None
    fsdp: DeviceMesh | None
    dp_replicate: int = 1
    rows: DeviceMesh | None = None

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshSlices:
        """The slices of ``mesh``, checked as :func:`split_mesh` checks it."""
        dp, tp = split_mesh(mesh)
        fsdp = fsdp_mesh(mesh)
        replicas = mesh["dp_replicate"].size() if fsdp is not None else 1
        return cls(mesh, tp, dp, cp_mesh(mesh), fsdp, replicas, dp_mesh_of(mesh) if dp is not None else None)

    @property
    def dims(self) -> ParallelDims:
        """This mesh's sizes: tp, dp (without cp), cp, dp_replicate; ep 1 (expert parallelism borrows
        its ranks from dp x cp, it is no dim of the mesh) and pp 1 (one stage's mesh)."""
        cp = self.cp.size() if self.cp is not None else 1
        dp = self.dp.size() // cp if self.dp is not None else 1
        return ParallelDims(tp=self.tp.size(), dp=dp, cp=cp, dp_replicate=self.dp_replicate)


def stage_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The dims of a pipeline mesh but ``pp``: each stage's own mesh, ``mesh[stage_dims(mesh)]``."""
    return tuple(n for n in mesh.mesh_dim_names or () if n != "pp")


def pp_size(mesh: DeviceMesh) -> int:
    """The size of the ``pp`` dim of ``mesh``'s root mesh (1 without pipeline parallelism)."""
    root = root_mesh(mesh)
    return root["pp"].size() if "pp" in (root.mesh_dim_names or ()) else 1


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The ``dp`` dim of a 2-D or 3-D mesh from :func:`build_mesh`: every dp rank's own rows (with
    HSDP both dp dims flattened, re-flattened rather than sliced from the root, which torch
    deprecates for flattened dims)."""
    if mesh.mesh_dim_names == HSDP_DIMS:
        return flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    return mesh["dp"]


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 2-D ``("dp_replicate", "dp_shard")`` mesh FSDP2 takes for HSDP (weights sharded over
    dp_shard, replicated over dp_replicate), or None when the mesh has no HSDP dims."""
    return mesh["dp_replicate", "dp_shard"] if mesh.mesh_dim_names == HSDP_DIMS else None


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ``cp`` dim of a mesh from :func:`build_mesh`, or None without context parallelism."""
    names = mesh.mesh_dim_names or ()
    return mesh["cp"] if "cp" in names and mesh["cp"].size() > 1 else None


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh]:
    """Return ``(dp_mesh or None, tp_mesh)`` of a 1-D (tp) or 2-D ``("dp", "tp")`` mesh; of a 3-D
    ``("dp", "cp", "tp")`` one the dp mesh is dp x cp flattened (FSDP2 shards over both), of a
    ``("dp_replicate", "dp_shard", "tp")`` one both dp dims flattened.

    Checks are local (no collectives), so every rank raises the same error.
    """
    names = mesh.mesh_dim_names
    if dist.is_initialized() and mesh.size() * pp_size(mesh) != dist.get_world_size():
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
    if mesh.ndim == 3 and names == ("dp", "cp", "tp"):
        return flatten_mesh(mesh["dp", "cp"], "dp_cp"), mesh["tp"]
    if mesh.ndim == 3 and names == HSDP_DIMS:  # the dp mesh is both dims flattened; FSDP2 takes fsdp_mesh
        return flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp"), mesh["tp"]
    raise ValueError(
        f"the mesh must be 1-D (tp), 2-D with dims named ('dp', 'tp') or 3-D ('dp', 'cp', 'tp') or "
        f"('dp_replicate', 'dp_shard', 'tp'), got "
        f"ndim={mesh.ndim}, mesh_dim_names={names}; build it with hf_tp.build_mesh(tp=..., cp=..., dp=...)"
    )
