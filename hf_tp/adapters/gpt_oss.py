"""GPT-OSS: the generic plan, with the tensor-parallel plan transformers does not give it.

transformers ships GPT-OSS with an expert-parallel plan and (since 5.24) a tensor-parallel plan
that names only the embedding. Its layer is Llama-shaped attention plus one MoE block, so hf_tp
writes the layer plan the generic derivation starts from:

- attention: q/k/v column-parallel, o row-parallel; the per-head attention sinks (one learned
  logit per head that joins each softmax) follow their heads (``local_params``);
- experts: stored transposed (``[experts, in, out]``), so the intermediate dim is the last one of
  ``gate_up_proj`` ``[E, hidden, 2 * inter]`` and the middle one of ``down_proj``
  ``[E, inter, hidden]``. Gate and up columns are interleaved (``gate = [..., ::2]``), so a
  contiguous slice of ``2 * inter / tp`` columns holds matching gate/up pairs: a plain split,
  not a packed one (tp must divide ``inter``, which the split of ``down_proj`` checks). The
  experts' biases follow their weights: ``gate_up_proj_bias`` split with its columns,
  ``down_proj_bias`` added once (:mod:`hf_tp.adapters.inspect_moe`);
- the router (a Linear with a bias, recorded by HF for the aux loss) is replicated.

Style names are transformers' (they name the split dim of the 3-D weight: ``rowwise`` -1,
``colwise`` -2), not the projection's role.
"""

from hf_tp.adapters.overrides import register_plan_overrides

register_plan_overrides(
    ("gpt_oss",),
    {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.sinks": "colwise",
        "layers.*.self_attn": "local_params",
        "layers.*.mlp.experts.gate_up_proj": "rowwise",
        "layers.*.mlp.experts.down_proj": "colwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    },
)
