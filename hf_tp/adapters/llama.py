"""Llama: the Megatron TP+SP plan that Qwen2 and Mistral reuse (same module names).

Sequence parallel keeps the residual stream a ``DTensor`` sharded on the sequence dim
(``use_local_output=False`` on the three producers of Shard(1): the embedding, ``o_proj`` and
``down_proj``). The model then sees the global sequence length when it builds rotary tables and
the causal/padding mask; with local tensors it would silently mask the wrong positions.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from hf_tp.adapters.adapter import Adapter, Plan, PlanOptions
from hf_tp.adapters.registry import register_adapter
from hf_tp.styles import ReplicatedKVProjection


def kv_projection(opts: PlanOptions) -> ParallelStyle:
    """``k_proj``/``v_proj``: sharded by KV head, or whole on every rank when tp > KV heads."""
    if opts.kv_replicas == 1:
        return ColwiseParallel()
    return ReplicatedKVProjection(opts.kv_replicas)


def layer_plan(opts: PlanOptions) -> Plan:
    """One decoder layer: attention and MLP are each a column-then-row parallel pair."""
    if not opts.sequence_parallel:
        # Replicated residual (plain local tensors, full sequence): no input preparation needed.
        return {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": kv_projection(opts),
            "self_attn.v_proj": kv_projection(opts),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
    return {
        "input_layernorm": SequenceParallel(),
        # Attention is called with hidden_states=... as a keyword: gather the sequence (all-gather).
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": kv_projection(opts),
        "self_attn.v_proj": kv_projection(opts),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        # The MLP is called positionally: self.mlp(hidden_states).
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def top_plan(opts: PlanOptions) -> Plan:
    """Embedding (vocab-sharded rows), final norm and lm_head (vocab-sharded columns)."""
    seq = Shard(1) if opts.sequence_parallel else Replicate()
    if opts.loss_parallel:
        # Logits stay a DTensor sharded on vocab; cross entropy runs under loss_parallel().
        head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    else:
        head = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    plan: Plan = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not opts.sequence_parallel
        ),
        "lm_head": head,
    }
    if opts.sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    return plan


register_adapter(Adapter(model_type="llama", layer_plan=layer_plan, top_plan=top_plan, plain_lm_head=True))
