"""Qwen3-VL's language model: transformers' tp plan for ``qwen3_vl_text`` names only the embedding
(its decoder layers would stay whole), although its layers are Qwen3's (q/k/v/o and a gated MLP,
per-head ``q_norm``/``k_norm`` over ``head_dim``). hf_tp gives it Qwen3's plan; the generic
derivation reads the rest off the model. (Qwen3-VL-MoE's text config carries its full plan.)
"""

from hf_tp.adapters.overrides import register_plan_overrides

register_plan_overrides(
    ("qwen3_vl_text",),
    {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
)
