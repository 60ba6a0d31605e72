"""Qwen3: Llama's plan plus the per-head RMSNorms on queries and keys (``q_norm``, ``k_norm``).

``q_norm``/``k_norm`` normalise each head over ``head_dim`` right after ``q_proj``/``k_proj``,
so under tp they run on the rank's own heads: nothing to communicate in forward. Their weight
(``head_dim`` numbers) is shared by all heads, though, so each rank's gradient covers only its
heads and the tp ranks' gradients must be summed. Treating the local heads as a shard of a
DTensor on the heads dim (dim 2 of ``(batch, seq, heads, head_dim)``) with a replicated weight
makes DTensor produce that gradient as ``Partial(sum)``, reduced like the sequence-parallel norm
weights (a plain local weight would train on one rank's heads only, silently).
"""

from __future__ import annotations

from hf_tp.adapters import llama
from hf_tp.adapters.adapter import Adapter, Plan, PlanOptions
from hf_tp.adapters.registry import register_adapter
from hf_tp.styles import head_norm


def layer_plan(opts: PlanOptions) -> Plan:
    """Llama's layer plan; ``q_norm`` and ``k_norm`` on the local heads (with or without SP)."""
    return {**llama.layer_plan(opts), "self_attn.q_norm": head_norm(), "self_attn.k_norm": head_norm()}


register_adapter(Adapter(model_type="qwen3", layer_plan=layer_plan, top_plan=llama.top_plan, plain_lm_head=True))
