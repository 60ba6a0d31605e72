"""Qwen2: Llama's plan as is. The q/k/v biases are sharded with their weights by ColwiseParallel."""

from hf_tp.adapters import llama
from hf_tp.adapters.adapter import Adapter
from hf_tp.adapters.registry import register_adapter

register_adapter(Adapter(model_type="qwen2", layer_plan=llama.layer_plan, top_plan=llama.top_plan, plain_lm_head=True))
