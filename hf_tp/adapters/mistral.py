"""Mistral: Llama's plan as is. The sliding-window mask is built from the global sequence
length, which the DTensor residual stream preserves."""

from hf_tp.adapters import llama
from hf_tp.adapters.adapter import Adapter
from hf_tp.adapters.registry import register_adapter

register_adapter(
    Adapter(model_type="mistral", layer_plan=llama.layer_plan, top_plan=llama.top_plan, plain_lm_head=True)
)
