"""hf_tp: tensor + sequence parallel (with FSDP2 data parallel) training of HF causal LMs."""

from hf_tp.adapters import Adapter, PlanOptions, get_adapter, register_adapter, supported_model_types
from hf_tp.parallel import build_mesh, loss_parallel, parallelize

__version__ = "0.1.0"

# The training, checkpoint and inference entry points pull in datasets and more: import lazily.
_LAZY = {
    "TrainConfig": "hf_tp.train.config",
    "fit": "hf_tp.train.loop",
    "export": "hf_tp.checkpoint.export",
    "push_to_hub": "hf_tp.checkpoint.hub",
    "generate": "hf_tp.inference",
    "evaluate": "hf_tp.inference",
    "shutdown": "hf_tp.train.setup",
    "causal_lm_loss": "hf_tp.parallel.linear_ce",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        attr = {"fit": "train", "export": "export_checkpoint"}.get(name, name)
        return getattr(module, attr)
    raise AttributeError(f"module 'hf_tp' has no attribute {name!r}")


__all__ = [
    "Adapter",
    "TrainConfig",
    "causal_lm_loss",
    "evaluate",
    "export",
    "fit",
    "generate",
    "push_to_hub",
    "shutdown",
    "PlanOptions",
    "build_mesh",
    "get_adapter",
    "loss_parallel",
    "parallelize",
    "register_adapter",
    "supported_model_types",
]
