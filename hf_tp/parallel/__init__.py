"""Parallelism: mesh, tensor/sequence parallel plans, FSDP2, loss parallel."""

from hf_tp.core.mesh import build_mesh, split_mesh
from hf_tp.parallel.api import parallelize
from hf_tp.parallel.loss_parallel import loss_parallel

__all__ = ["build_mesh", "loss_parallel", "parallelize", "split_mesh"]
