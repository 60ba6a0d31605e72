"""Causal LMs that transformers maps under another auto task only.

transformers 5.24 lists ``Mistral4ForCausalLM`` under image-text-to-text, multimodal-LM and
pretraining but not under ``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_config`` refuses
its config although the class is a plain decoder-only causal LM. hf_tp registers each such
``*ForCausalLM`` class with ``AutoModelForCausalLM`` (transformers' own class, nothing rewritten),
so every loader that builds through the auto class builds it.
"""

from __future__ import annotations

_MAPS = (
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
)


def causal_lms_mapped_elsewhere() -> dict[str, str]:
    """``model_type`` -> its ``*ForCausalLM`` class name, for those the causal-LM auto map lacks."""
    from transformers.models.auto import modeling_auto as auto

    out: dict[str, str] = {}
    for name in _MAPS:
        for model_type, cls in getattr(auto, name, {}).items():
            if (
                isinstance(cls, str)
                and cls.endswith("ForCausalLM")
                and model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            ):
                out.setdefault(model_type, cls)
    return out


def register_causal_lms() -> None:
    """Register every class of :func:`causal_lms_mapped_elsewhere` with ``AutoModelForCausalLM``."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    for model_type, name in causal_lms_mapped_elsewhere().items():
        cls = getattr(transformers, name, None)
        if model_type in CONFIG_MAPPING and isinstance(cls, type):
            AutoModelForCausalLM.register(CONFIG_MAPPING[model_type], cls, exist_ok=True)
