"""Parallelism: mesh, tensor/sequence parallel plans, FSDP2, loss parallel."""

from hf_tp.core.mesh import build_mesh, split_mesh
from hf_tp.parallel.api import apply_prepared, parallelize
from hf_tp.parallel.loss_parallel import loss_parallel
from hf_tp.parallel.prepare import Prepared, prepare

__all__ = ["Prepared", "apply_prepared", "build_mesh", "loss_parallel", "parallelize", "prepare", "split_mesh"]
