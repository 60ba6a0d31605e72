"""hf_tp: tensor + sequence parallel (with FSDP2 data parallel) training of HF causal LMs."""

from hf_tp.adapters import Adapter, PlanOptions, get_adapter, register_adapter, supported_model_types
from hf_tp.parallel import build_mesh, loss_parallel, parallelize

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "PlanOptions",
    "build_mesh",
    "get_adapter",
    "loss_parallel",
    "parallelize",
    "register_adapter",
    "supported_model_types",
]
