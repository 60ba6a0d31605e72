"""OLMo 2 and OLMo 3: the generic plan, with q/k normalised over the whole projection width.

Their ``q_norm``/``k_norm`` are RMSNorms over all heads at once (``num_heads * head_dim``), applied
before the heads are split. transformers' plan therefore gathers the q/k/v outputs
(``colwise_gather_output``) and splits the attention output again (``rowwise_split_input``): an
all-gather of b*s*(q+k+v) and a split per layer. hf_tp keeps the projections column-parallel and
runs the norms on each rank's columns with a sharded weight (:class:`WidthNormParallel`): the
mean over the width costs one all-reduce of two per-token sums. KV heads cannot be replicated then
(the k norm needs every KV head's columns once), so tp must divide num_key_value_heads.
"""

from hf_tp.adapters.overrides import register_plan_overrides

register_plan_overrides(
    ("olmo2", "olmo3"),
    {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.q_norm": "width_norm",
        "layers.*.self_attn.k_norm": "width_norm",
    },
)
