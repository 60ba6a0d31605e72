"""hf_tp: tensor + sequence parallel (with FSDP2 data parallel) training of HF causal LMs.

Every public name is imported on first use (module ``__getattr__``), so ``import hf_tp`` and
``hf-tp --help`` load neither torch nor transformers nor datasets.
"""

from __future__ import annotations

from hf_tp.lazy import lazy_names

__version__ = "0.1.0"

# public name -> the module that defines it, or (module, attribute) where it has another name there
_PUBLIC: dict[str, str | tuple[str, str]] = {
    "Adapter": "hf_tp.adapters",
    "PlanOptions": "hf_tp.adapters",
    "get_adapter": "hf_tp.adapters",
    "register_adapter": "hf_tp.adapters",
    "supported_model_types": "hf_tp.adapters",
    "ParallelDims": "hf_tp.core.dims",
    "build_mesh": "hf_tp.parallel",
    "loss_parallel": "hf_tp.parallel",
    "parallelize": "hf_tp.parallel",
    "prepare": "hf_tp.parallel",
    "apply_prepared": "hf_tp.parallel",
    "Prepared": "hf_tp.parallel",
    "causal_lm_loss": "hf_tp.parallel.linear_ce",
    "TrainConfig": "hf_tp.run.config",
    "fit": ("hf_tp.train.loop", "train"),
    "shutdown": "hf_tp.run.distributed",
    "save_checkpoint": ("hf_tp.checkpoint.dcp", "save"),
    "export": ("hf_tp.checkpoint.hf_folder", "export_checkpoint"),
    "push_to_hub": "hf_tp.checkpoint.hub",
    "generate": "hf_tp.parallel.generate",
    "evaluate": "hf_tp.parallel.held_out",
    "embedded_default": ("hf_tp.demo.assets", "ensure_default_assets"),
    "plan_for": "hf_tp.plan",
    "describe": "hf_tp.plan.describe",
    "ParallelRecord": "hf_tp.core.record",
    "record_of": "hf_tp.core.record",
}


__getattr__ = lazy_names(__name__, _PUBLIC)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = sorted(_PUBLIC)
