"""Text towers with no causal LM of their own: read their plan from the base model plus an lm_head.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL (-MoE) and GLM-4V keep their language model as a bare
``*TextModel`` (``qwen2_5_vl_text``, ...): transformers maps it under ``AutoModel`` only, the
lm_head lives in the wrapper. hf_tp reads a text tower's plan from a causal LM, so for these it
builds one on the meta device: the tower's base model at ``model`` and a bias-free lm_head over
the vocabulary, the layout every such wrapper keeps (``model.language_model`` beside ``lm_head``);
the wrapper's own lm_head and forward are checked against it where it is placed
(:mod:`hf_tp.adapters.wrapper`). Never trained or exported: it exists to be read.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig


def has_causal_lm(config: PretrainedConfig) -> bool:
    """transformers builds a causal LM for ``config`` (``AutoModelForCausalLM`` maps its class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING


def is_text_tower(config: PretrainedConfig) -> bool:
    """A language model with no causal LM of its own, only a base model (a wrapper's text tower)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return not has_causal_lm(config) and type(config) in MODEL_MAPPING


class TextTowerLM(nn.Module):
    """A text tower's base model at ``model`` and an lm_head, read for its plan (meta device only)."""

    base_model_prefix = "model"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = AutoModel.from_config(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> nn.Module:
        return self.model

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """The logits, plainly ``lm_head`` of the last hidden state (how the wrappers compute them)."""
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states)
        return logits


def causal_lm_from_config(config: PretrainedConfig) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)``, or a :class:`TextTowerLM` for a text tower."""
    if is_text_tower(config):
        return TextTowerLM(config)
    return AutoModelForCausalLM.from_config(config)
