"""Refusing quantized checkpoints with the command that dequantizes them.

Published MoE checkpoints often store their weights quantized (GPT-OSS's experts in MXFP4,
DeepSeek-V3's in block FP8 with scales). hf_tp trains full-precision weights: reading such files
as if they were plain tensors would train on the raw codes, and transformers' quantized modules
are not the modules a plan is derived from. Both are refused before anything is loaded, with the
one-time conversion that transformers itself offers where it has one.
"""

from __future__ import annotations

import copy

from transformers import PretrainedConfig

from hf_tp.compat.torch_internals import pop_own_attribute

# quant_method -> transformers' config class that loads it dequantized (``dequantize=True``)
DEQUANTIZING = {"mxfp4": "Mxfp4Config", "fp8": "FineGrainedFP8Config"}


def quant_method(config: PretrainedConfig) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (a dict in config.json, an object
    once transformers has read it), or None for full-precision weights."""
    q = getattr(config, "quantization_config", None)
    if not q:  # (an old-style config may carry transformers' load_in_4bit / load_in_8bit flags)
        return "bitsandbytes" if _bnb_bits(config) else None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def check_not_quantized(config: PretrainedConfig) -> None:
    """Raise a ``ValueError`` naming the quantization and the fix for a quantized checkpoint."""
    method = quant_method(config)
    if method is None:
        return
    if method == "bitsandbytes":
        raise ValueError(_bnb_refusal(config))
    what = f"this {config.model_type} checkpoint is quantized (quant_method '{method}'); hf_tp trains full-precision weights"
    if method in DEQUANTIZING:
        cls = DEQUANTIZING[method]
        name = getattr(config, "_name_or_path", "") or "MODEL"
        copy = name.rstrip("/").rsplit("/", 1)[-1] + "-bf16"
        raise ValueError(
            f'{what}. Dequantize it once and train the copy: python -c "import torch; from transformers import '
            f"AutoModelForCausalLM, {cls}; AutoModelForCausalLM.from_pretrained('{name}', "
            f"quantization_config={cls}(dequantize=True), dtype=torch.bfloat16).save_pretrained('{copy}')\""
        )
    raise ValueError(f"{what}: train its unquantized base model instead")


def _bnb_bits(config_or_q) -> int | None:
    """4 or 8 for a bitsandbytes ``load_in_4bit`` / ``load_in_8bit`` flag (a dict or an object)."""
    for bits in (4, 8):
        key = f"load_in_{bits}bit"
        if (config_or_q.get(key) if isinstance(config_or_q, dict) else getattr(config_or_q, key, False)) is True:
            return bits
    return None


def _bnb_refusal(config: PretrainedConfig) -> str:
    """The one line for a bitsandbytes (QLoRA) base."""
    q = getattr(config, "quantization_config", None)
    bits = _bnb_bits(q) if q else _bnb_bits(config)
    return (
        f"this {config.model_type} model is quantized with bitsandbytes ({bits or '4- or 8'}-bit, QLoRA): its packed "
        "weights do not compose with DTensor sharding today; train LoRA on the bf16 base under tp (hf-tp train --lora-r R "
        "on the unquantized checkpoint, --dtype bf16), or QLoRA with peft + bitsandbytes on one GPU"
    )


def full_precision(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` without its quantization (a copy): the model its dequantized copy is, which is
    what hf_tp would train (``hf-tp estimate`` sizes that for a quantized Hub checkpoint)."""
    if quant_method(config) is None:
        return config
    out = copy.deepcopy(config)
    if getattr(out, "quantization_config", None):
        del out.quantization_config
    for flag in ("load_in_4bit", "load_in_8bit"):
        pop_own_attribute(out, flag)
    return out
