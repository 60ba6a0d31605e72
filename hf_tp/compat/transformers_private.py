"""transformers' private names hf_tp calls or patches: the estimate's two patches, the output-capture
registry, building a model class from a config, the experts kernel switch, DeepStack's merge.

Each reads what the installed release offers (docs/compatibility.md lists them per release).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from hf_tp.compat.reaches import reaches, register
from hf_tp.compat.torch_fake import is_fake

DEEPSTACK = "_deepstack_process"  # transformers' name for the merge (Qwen3-VL, Qwen3-VL-MoE, Cohere Compass)
LOSS_FUNCTION_SLOT = "_loss_function"  # where PreTrainedModel's loss_function property keeps what is set
register(
    f"{__name__}.LOSS_FUNCTION_SLOT",
    "transformers:PreTrainedModel.loss_function",
    sets=(f"transformers:PreTrainedModel.{LOSS_FUNCTION_SLOT}",),
)


@reaches("transformers.masking_utils:_ignore_causal_mask_sdpa")
@contextlib.contextmanager
def unmasked_causal_attention() -> Iterator[None]:
    """Let HF use plain causal attention for the fake all-ones mask, as it does for a real one.

    HF drops an all-ones 2-D mask after reading its values (sdpa then runs with ``is_causal`` and
    grouped KV heads). Fake tensors have no values, so HF would instead build a (batch, 1, seq,
    seq) mask and repeat the KV heads, memory a real run does not use.
    """
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa

    # Only the first argument (the padding mask) is read: the rest pass through as given, since
    # their number changed across releases (5.9 has no q_offset; later releases add it).
    def ignore(padding_mask, *args, **kwargs) -> bool:
        if padding_mask is not None and is_fake(padding_mask):
            padding_mask = None  # the estimate's masks are all ones
        return original(padding_mask, *args, **kwargs)

    masking_utils._ignore_causal_mask_sdpa = ignore
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


@reaches("transformers.integrations.moe:_can_use_grouped_mm")
@contextlib.contextmanager
def fake_grouped_mm_any_dtype() -> Iterator[None]:
    """Let transformers' ``grouped_mm`` experts run on fake fp32 tensors.

    torch's meta kernel of ``grouped_mm`` accepts bf16 only, while real CPU and GPU kernels also
    take fp32. For fake tensors of another dtype, transformers' own fallback op (a loop of
    matmuls, with a registered fake kernel) runs instead: same output and saved tensors.
    """
    import torch
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm

    def can_use(input, weight, offs) -> bool:
        if is_fake(weight) and weight.dtype != torch.bfloat16:
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@reaches("transformers.utils.output_capturing:_CAN_RECORD_REGISTRY")
def keep_output_capture(model: Any) -> None:
    """Give each module FSDP2 re-classed (``FSDP<Name>``) its class's output-capture flags back.

    transformers (5.x) looks a model's ``_can_record_outputs`` up by its class's name, so after
    ``fully_shard`` a vision tower no longer records the hidden states its wrapper selects from
    (LLaVA's ``vision_feature_layer``: ``'NoneType' object is not subscriptable``).
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry  # private, no public API
    except ImportError:
        return
    for module in model.modules():
        key = str(type(module))
        if key in registry:
            continue
        found = next((str(c) for c in type(module).__mro__[1:] if str(c) in registry), None)
        if found is not None:
            dict.__setitem__(registry, key, dict.get(registry, found))


@reaches("transformers:PreTrainedModel._from_config")
def model_of_class(cls: type, config: Any, **kwargs: Any) -> Any:
    """A new model of the class ``cls`` from ``config`` (what ``AutoModel*.from_config`` calls)."""
    return cls._from_config(config, **kwargs)


@reaches("transformers:PreTrainedModel._can_set_experts_implementation")
def can_set_experts_implementation(module: Any) -> bool:
    """Whether ``module`` (a model) takes ``set_experts_implementation`` (it has experts kernels)."""
    return module._can_set_experts_implementation()


@reaches(f"transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLTextModel.{DEEPSTACK}")
def deepstack_merge(model: Any) -> Callable | None:
    """The DeepStack merge (visual features added to the hidden states) ``model``'s class defines, or None."""
    return getattr(type(model), DEEPSTACK, None)


@reaches(f"transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLTextModel.{DEEPSTACK}")
def set_deepstack_merge(model: Any, merge: Callable) -> None:
    """Make ``model`` call ``merge(hidden_states, visual_pos_masks, visual_embeds)`` for its DeepStack merge."""
    setattr(model, DEEPSTACK, merge)
