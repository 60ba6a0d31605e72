"""Adapters: one file per model family, found through the registry by ``config.model_type``."""

from hf_tp.adapters import codegen, gemma, gpt_oss, layer_plans, llama, mistral, olmo2, qwen2, qwen3  # noqa: F401  (importing registers them)
from hf_tp.adapters.registry import (
    Adapter,
    Plan,
    PlanOptions,
    get_adapter,
    register_adapter,
    supported_model_types,
    unregister_adapter,
)

__all__ = [
    "Adapter",
    "Plan",
    "PlanOptions",
    "get_adapter",
    "register_adapter",
    "supported_model_types",
    "unregister_adapter",
]
