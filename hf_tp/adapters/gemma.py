"""Gemma, Gemma 2 and Gemma 3 (text): Llama's plan plus what each generation adds.

- All three scale the embedding by sqrt(hidden) inside the embedding module's forward. On the
  vocab-sharded lookup (a partial sum) that product would make DTensor all-reduce the whole
  ``b x s x h`` output before ``RowwiseParallel`` could reduce-scatter it; so the module runs the
  plain lookup and the scale is applied after the reduce-scatter (:class:`ScaledEmbeddingRowwise`;
  each token's row is nonzero on one rank only, so the values are the same).
- Their norms compute ``x * (1 + w)``: same layout as Llama's, sequence parallel.
- Gemma 2 and 3 add ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` and apply
  ``post_attention_layernorm`` to the attention output before the residual add; all four norms run
  on sequence shards (the attention and MLP outputs are reduce-scattered first).
- Gemma 3 adds per-head ``q_norm``/``k_norm``, handled as in Qwen3.
- Gemma 2 soft-caps its logits (``final_logit_softcapping``): the loss cannot be fused with the
  lm_head then, and training uses the logits (``hf_tp.parallel.linear_ce.fusable``).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from hf_tp.adapters import llama
from hf_tp.adapters.adapter import Adapter, Plan, PlanOptions
from hf_tp.adapters.registry import register_adapter
from hf_tp.styles import ScaledEmbeddingRowwise, head_norm


def top_plan(opts: PlanOptions) -> Plan:
    """Llama's top-level plan with the embedding's scale moved after its reduction."""
    plan = llama.top_plan(opts)
    emb = plan["model.embed_tokens"]
    plan["model.embed_tokens"] = ScaledEmbeddingRowwise(
        input_layouts=emb.input_layouts[0], output_layouts=emb.output_layouts[0], use_local_output=emb.use_local_output
    )
    return plan


def gemma2_layer_plan(opts: PlanOptions) -> Plan:
    """Llama's layer plan with the two extra feed-forward norms on sequence shards."""
    plan = llama.layer_plan(opts)
    if opts.sequence_parallel:
        plan["pre_feedforward_layernorm"] = SequenceParallel()
        plan["post_feedforward_layernorm"] = SequenceParallel()
    return plan


def gemma3_layer_plan(opts: PlanOptions) -> Plan:
    """Gemma 2's layer plan with Qwen3's per-head q/k norms."""
    return {**gemma2_layer_plan(opts), "self_attn.q_norm": head_norm(), "self_attn.k_norm": head_norm()}


register_adapter(Adapter(model_type="gemma", layer_plan=llama.layer_plan, top_plan=top_plan, plain_lm_head=True))
register_adapter(Adapter(model_type="gemma2", layer_plan=gemma2_layer_plan, top_plan=top_plan, plain_lm_head=True))
register_adapter(Adapter(model_type="gemma3_text", layer_plan=gemma3_layer_plan, top_plan=top_plan, plain_lm_head=True))
