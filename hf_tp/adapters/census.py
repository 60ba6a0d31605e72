"""The installed transformers' causal-LM families that carry a tensor-parallel plan: what the
family grid (tests, ``scripts/family_grid.py``) runs and ``docs/architectures.md`` counts."""

from __future__ import annotations

from hf_tp.adapters import get_adapter
from hf_tp.adapters.families import PLAN_OVERRIDES
from hf_tp.core.module_queries import experts_per_token, num_experts
from hf_tp.moe.expert_parallel import experts_modules


def tensor_parallel_causal_lm_types() -> dict[str, bool]:
    """Every causal-LM ``model_type`` of the installed transformers whose config carries a
    ``base_model_tp_plan``, mapped to whether it is a mixture of experts (:func:`is_mixture`)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_tp.adapters.causal_lm_map import causal_lms_mapped_elsewhere

    out = {}
    for model_type in [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *causal_lms_mapped_elsewhere()]:
        try:
            plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
        except KeyError:
            continue
        if plan:  # (GPT-OSS's names only the embedding: hf_tp's own plan for it shards experts)
            out[model_type] = is_mixture(CONFIG_MAPPING[model_type]())
    return out


def plan_less_causal_lm_types() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers whose config carries no
    ``base_model_tp_plan`` (and no hf_tp correction to one): hf_tp reads their plan from the
    model's modules (:mod:`hf_tp.adapters.inspect_plan`) or refuses them."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_tp.adapters.causal_lm_map import causal_lms_mapped_elsewhere

    out = []
    for model_type in [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *causal_lms_mapped_elsewhere()]:
        try:
            plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)
        except KeyError:
            continue
        if not plan and model_type not in PLAN_OVERRIDES:
            out.append(model_type)
    return sorted(set(out))


def is_mixture(config) -> bool:
    """``config`` builds a mixture of experts: transformers' tp or ep plan (5.25 keeps experts in
    the ep plan only) or hf_tp's overrides name experts."""
    plans = {
        **(getattr(config, "base_model_tp_plan", None) or {}),
        **(getattr(config, "base_model_ep_plan", None) or {}),
        **PLAN_OVERRIDES.get(config.model_type, {}),
    }
    return any("expert" in key for key in plans)


def multimodal_wrapper_types() -> dict[str, str]:
    """Every multimodal wrapper ``model_type`` of the installed transformers (an image-text-to-text
    or multimodal-LM model whose config carries a ``text_config``), mapped to its language
    model's ``model_type``."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    from hf_tp.core.model_source import text_config_of

    names = set(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) | set(auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES)
    out = {}
    for model_type in sorted(names):
        try:
            text = text_config_of(CONFIG_MAPPING[model_type]())
        except Exception:  # noqa: BLE001, S112 - a config class that cannot be built at its defaults has no census entry
            continue
        if text is not None:
            out[model_type] = text.model_type
    return out


def unrouted_expert_params(model, config) -> int:
    """Parameters of the routed experts one token does not use, (1 - top_k / experts) of every
    experts module's weights (0 for a dense model): what :func:`hf_tp.gpus.model_flops_per_token`
    leaves out of N. Counted from the model (DTensors count their global size)."""
    adapter = get_adapter(config)
    text = adapter.layers_config(config)
    total, top_k = num_experts(text), experts_per_token(text)
    if not adapter.moe or not total or not top_k or top_k >= total:
        return 0
    weights = sum(
        p.numel() for _, m in experts_modules(model, adapter.layers_path, adapter.experts) for p in m.parameters()
    )
    return int(weights * (1 - top_k / total))
