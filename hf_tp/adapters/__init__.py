"""Adapters: how each model family is tensor-parallelized, found by ``config.model_type``.

Layers, each importing only those below it:
  registry, census          find the adapter for a config (hand-written, refused, wrapper, or derived)
  wrapper                   a multimodal wrapper: its language model's adapter re-rooted, passengers
  generic                   the rules: facts read off a model -> the TP+SP plans of an Adapter
  inspect_plan              a tp plan read off the modules where transformers gives none (OPT, GPT-Neo, ...)
  inspect_model             read a model: its layer kinds merged, embedding, final norms, lm_head
  mixers                    blocks whose kind changes by layer (a plan entry per module class)
  inspect_layer             read one decoder layer: projections, norms, blocks and how it calls them
  inspect_moe               read a layer's mixture-of-experts blocks: each parameter's role
  families                  the family table: hand-written plans (Llama's and those reusing it),
                            corrections to transformers' tp plans, counts tp must divide
  adapter, facts,           the types (Adapter, Derivation), quantized-checkpoint refusals,
  quantized, support        the support tables (data)
  causal_lm_map             causal LMs transformers maps under another task only (Mistral 4), registered
  text_tower                text towers with no causal LM (Qwen2.5-VL's, ...): a base model + lm_head to read
A family is added as an entry of :data:`hf_tp.adapters.families.FAMILIES` (or, from outside, with
:func:`register_adapter`).
"""

from hf_tp.adapters.adapter import Adapter, Plan, PlanOptions
from hf_tp.adapters.causal_lm_map import register_causal_lms
from hf_tp.adapters.registry import get_adapter, register_adapter, supported_model_types, unregister_adapter

register_causal_lms()  # Mistral 4's causal LM, which transformers maps under image-text-to-text only

__all__ = [
    "Adapter",
    "Plan",
    "PlanOptions",
    "get_adapter",
    "register_adapter",
    "supported_model_types",
    "unregister_adapter",
]
