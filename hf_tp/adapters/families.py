"""The family table: what hf_tp says about a model family that the model itself does not.

Most families need no entry: their plan is derived from the model and transformers' tp plan
(:mod:`hf_tp.adapters.generic`). An entry of :data:`FAMILIES` (``model_type`` -> :class:`Family`)
says one of three things, and ``why``:

- ``layer_plan`` and ``top_plan``: a hand-written plan, registered as the family's :class:`Adapter`
  (Llama's Megatron plan, which Qwen2, Mistral, Qwen3 and Gemma reuse with their additions);
- ``tp_plan``: entries of transformers' ``base_model_tp_plan`` corrected or added (its keys and
  style names, plus hf_tp's ``width_norm``), which the generic derivation starts from;
- ``tp_divides``: a count fixed in the family's code (not its config) that tp must divide.

The shared pieces sit above the table. Plans and data only: the registry
(:mod:`hf_tp.adapters.registry`) and the generic derivation read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from transformers import PretrainedConfig

from hf_tp.adapters.adapter import Adapter, Plan, PlanOptions
from hf_tp.styles import ReplicatedKVProjection, ScaledEmbeddingRowwise, head_norm

PlanFn = Callable[[PlanOptions], Plan]


@dataclass(frozen=True)
class Family:
    """What hf_tp knows about one family beyond its model (see the module docstring)."""

    why: str
    layer_plan: PlanFn | None = None
    top_plan: PlanFn | None = None
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_divides: tuple[str, int] | None = None  # (what the count is, the count)


# --- Llama's Megatron TP+SP plan -----------------------------------------------------------------
# Sequence parallel keeps the residual stream a DTensor sharded on the sequence dim
# (use_local_output=False on the three producers of Shard(1): the embedding, o_proj and down_proj).
# The model then sees the global sequence length when it builds rotary tables and the causal /
# padding mask; with local tensors it would silently mask the wrong positions.


def kv_projection(opts: PlanOptions) -> ParallelStyle:
    """``k_proj``/``v_proj``: sharded by KV head, or whole on every rank when tp > KV heads."""
    if opts.kv_replicas == 1:
        return ColwiseParallel()
    return ReplicatedKVProjection(opts.kv_replicas)


def llama_layer_plan(opts: PlanOptions) -> Plan:
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


def llama_top_plan(opts: PlanOptions) -> Plan:
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


def with_head_norms(layer_plan: PlanFn) -> PlanFn:
    """``layer_plan`` plus per-head RMSNorms on queries and keys (``q_norm``, ``k_norm`` over
    ``head_dim``, right after ``q_proj``/``k_proj``). They run on the rank's own heads, nothing to
    communicate in forward; their weight is shared by all heads, so the tp ranks' gradients must
    be summed: :func:`hf_tp.styles.head_norm` treats the local heads as a DTensor shard on the
    heads dim with a replicated weight, whose gradient DTensor then gives as ``Partial(sum)``
    (a plain local weight would train on one rank's heads only, silently)."""

    def plan(opts: PlanOptions) -> Plan:
        return {**layer_plan(opts), "self_attn.q_norm": head_norm(), "self_attn.k_norm": head_norm()}

    return plan


# --- Gemma's additions ---------------------------------------------------------------------------


def gemma_top_plan(opts: PlanOptions) -> Plan:
    """Llama's top-level plan with the embedding's sqrt(hidden) scale moved after its reduction.
    Gemma scales the embedding inside the embedding module's forward: on the vocab-sharded lookup
    (a partial sum) that product would make DTensor all-reduce the whole ``b x s x h`` output before
    ``RowwiseParallel`` could reduce-scatter it. :class:`ScaledEmbeddingRowwise` runs the plain
    lookup and scales after the reduce-scatter (each token's row is nonzero on one rank only, so
    the values are the same)."""
    plan = llama_top_plan(opts)
    emb = plan["model.embed_tokens"]
    plan["model.embed_tokens"] = ScaledEmbeddingRowwise(
        input_layouts=emb.input_layouts[0], output_layouts=emb.output_layouts[0], use_local_output=emb.use_local_output
    )
    return plan


def gemma2_layer_plan(opts: PlanOptions) -> Plan:
    """Llama's layer plan with the two extra feed-forward norms on sequence shards."""
    plan = llama_layer_plan(opts)
    if opts.sequence_parallel:
        plan["pre_feedforward_layernorm"] = SequenceParallel()
        plan["post_feedforward_layernorm"] = SequenceParallel()
    return plan


# --- Layer plans for families whose transformers plan shards only the embedding (or the experts) --
# transformers (5.24) ships them with base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}:
# its TP leaves every decoder layer whole. Their layers are Megatron-shaped, so the generic
# derivation needs only the projections named; it reads the rest off the modules as for any family
# (per-head q/k norms, per-head output gates, Mamba and short-convolution mixers that run whole on
# every rank with their parameters replicated). Each holds parity at tp=2 and 4 in the family grid.


def attention(out: str = "o_proj") -> dict[str, str]:
    """q/k/v column-parallel, the output projection ``out`` row-parallel."""
    qkv = {f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
    return {**qkv, f"layers.*.self_attn.{out}": "rowwise"}


def gated_mlp(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> dict[str, str]:
    """A gated MLP at ``block``: gate and up column-parallel, down row-parallel."""
    return {
        f"layers.*.{block}.{gate}": "colwise",
        f"layers.*.{block}.{up}": "colwise",
        f"layers.*.{block}.{down}": "rowwise",
    }


LFM2_LAYERS = {**attention("out_proj"), **gated_mlp("feed_forward", "w1", "w3", "w2")}  # w1 gate, w3 up, w2 down

# --- The table -----------------------------------------------------------------------------------

FAMILIES: dict[str, Family] = {
    # hand-written plans
    "llama": Family("the reference Megatron TP+SP plan", llama_layer_plan, llama_top_plan),
    "qwen2": Family(
        "Llama's plan as is: the q/k/v biases are sharded with their weights by ColwiseParallel",
        llama_layer_plan,
        llama_top_plan,
    ),
    "mistral": Family(
        "Llama's plan as is: the sliding-window mask is built from the global sequence length, which the "
        "DTensor residual stream keeps",
        llama_layer_plan,
        llama_top_plan,
    ),
    "qwen3": Family("Llama's plan plus per-head q/k norms", with_head_norms(llama_layer_plan), llama_top_plan),
    "gemma": Family(
        "Llama's plan, the embedding's scale after its reduce-scatter; its x * (1 + w) norms lay out as Llama's",
        llama_layer_plan,
        gemma_top_plan,
    ),
    "gemma2": Family(
        "Gemma's plan plus pre/post-feedforward norms; all four norms (post_attention_layernorm applied to the "
        "attention output before the residual add) run on sequence shards; its soft-capped logits "
        "(final_logit_softcapping) are never fused with the loss (hf_tp.parallel.linear_ce.fusable)",
        gemma2_layer_plan,
        gemma_top_plan,
    ),
    "gemma3_text": Family(
        "Gemma 2's plan with Qwen3's per-head q/k norms", with_head_norms(gemma2_layer_plan), gemma_top_plan
    ),
    # corrections to transformers' tp plan
    **dict.fromkeys(
        ("olmo2", "olmo3"),
        Family(
            "q/k norms over the whole projection width (num_heads * head_dim, before the heads are split): "
            "transformers gathers q/k/v (colwise_gather_output) and splits the attention output again, an "
            "all-gather of b*s*(q+k+v) per layer; hf_tp keeps the projections column-parallel and runs the "
            "norms on each rank's columns (WidthNormParallel: one all-reduce of two per-token sums). KV heads "
            "cannot be replicated then, so tp must divide num_key_value_heads",
            tp_plan={
                **attention(),
                "layers.*.self_attn.q_norm": "width_norm",
                "layers.*.self_attn.k_norm": "width_norm",
            },
        ),
    ),
    "gpt_oss": Family(
        "transformers' tp plan names only the embedding. Attention as Llama's, its per-head sinks following "
        "their heads (local_params). Experts are stored transposed ([experts, in, out]): gate_up_proj "
        "[E, hidden, 2 * inter] splits on its last dim, down_proj [E, inter, hidden] on its middle one (the "
        "style names are transformers': rowwise splits dim -1, colwise -2); gate and up columns interleave, "
        "so a contiguous slice holds matching pairs (a plain split, not a packed one); the experts' biases "
        "follow their weights (hf_tp.adapters.inspect_moe); the router is replicated",
        tp_plan={
            **attention(),
            "layers.*.self_attn.sinks": "colwise",
            "layers.*.self_attn": "local_params",
            "layers.*.mlp.experts.gate_up_proj": "rowwise",
            "layers.*.mlp.experts.down_proj": "colwise",
            "layers.*.mlp.experts": "moe_tp_experts",
        },
    ),
    "qwen3_vl_text": Family(
        "Qwen3-VL's language model: transformers' tp plan names only the embedding, its layers are Qwen3's "
        "(Qwen3-VL-MoE's text config carries its full plan)",
        tp_plan={
            **{f"layers.*.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
            "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.o_proj": "rowwise",
            **gated_mlp("mlp"),
        },
    ),
    "hunyuan_v1_dense": Family(
        "Llama layout, per-head query_layernorm / key_layernorm", tp_plan={**attention(), **gated_mlp("mlp")}
    ),
    "lfm2": Family("attention layers (out_proj) among short-convolution layers", tp_plan=LFM2_LAYERS),
    "lfm2_moe": Family("transformers' plan names only the experts; the other layers are LFM2's", tp_plan=LFM2_LAYERS),
    "lfm3": Family(
        "as LFM2, with g_proj: one sigmoid output gate per query head, split with the heads",
        tp_plan={**attention(), "layers.*.self_attn.g_proj": "colwise", **gated_mlp("feed_forward", "w1", "w3", "w2")},
    ),
    **dict.fromkeys(
        ("bamba", "falcon_h1"),
        Family(
            "Mamba-2 mixers (whole on every rank) beside attention, a gated feed_forward",
            tp_plan={**attention(), **gated_mlp("feed_forward")},
        ),
    ),
    "nemotron_h": Family(
        "one mixer per layer, Mamba-2, attention, a ReLU^2 MLP or a MoE block by layer index; transformers' "
        "plan names only the experts, hf_tp adds the attention and MLP projections (each layer's mixer gets "
        "its kind's plan: hf_tp.adapters.mixers)",
        tp_plan={
            **{f"layers.*.mixer.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj", "up_proj")},
            **{f"layers.*.mixer.{p}": "rowwise" for p in ("o_proj", "down_proj")},
        },
    ),
    # counts tp must divide
    "codegen": Family(
        "its qkv_proj output is laid out as mp_num = 4 groups (a constant in CodeGenAttention, from its "
        "original 4-way model-parallel training), each the q, v and k columns of a quarter of the heads: a "
        "column shard is whole groups only when tp divides 4 (the family grid checks tp=2 and 4)",
        tp_divides=("number of groups (mp_num) its attention packs qkv_proj into", 4),
    ),
}

# model_type -> its hand-written adapter (the registry starts with these)
HAND_WRITTEN: dict[str, Adapter] = {
    mt: Adapter(model_type=mt, layer_plan=f.layer_plan, top_plan=f.top_plan, plain_lm_head=True)
    for mt, f in FAMILIES.items()
    if f.layer_plan is not None and f.top_plan is not None
}
# model_type -> corrections to transformers' tp plan (same keys), what the generic derivation starts from
PLAN_OVERRIDES: dict[str, dict[str, str]] = {mt: dict(f.tp_plan) for mt, f in FAMILIES.items() if f.tp_plan}
# model_type -> (what, n): a count fixed in the family's code that tp must divide, beyond the config's sizes
TP_DIVISORS: dict[str, tuple[str, int]] = {mt: f.tp_divides for mt, f in FAMILIES.items() if f.tp_divides}


def base_tp_plan(config: PretrainedConfig) -> dict[str, str]:
    """transformers' ``base_model_tp_plan`` for ``config`` with hf_tp's corrections applied."""
    return {**(getattr(config, "base_model_tp_plan", None) or {}), **PLAN_OVERRIDES.get(config.model_type, {})}
