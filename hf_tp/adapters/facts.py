"""What reading a model finds: the facts a generic TP+SP plan is built from, and the refusal.

The bottom of the generic path: :mod:`hf_tp.adapters.inspect_model` fills a :class:`Derivation`
from a model, :mod:`hf_tp.adapters.generic` turns it into plans. Module paths are relative to a
decoder layer unless a field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_tp.moe.expert_styles import Role

HOW_TO_ADD = (
    "register a hand-written adapter with hf_tp.register_adapter(hf_tp.Adapter(model_type=..., layer_plan=..., "
    "top_plan=...)) (see hf_tp/adapters/families.py)"
)


def refuse(model_type: str, what: str) -> ValueError:
    """The error for a model the generic plan cannot place, naming what and the way out."""
    return ValueError(f"hf_tp cannot derive a TP+SP plan for model_type '{model_type}': {what}; {HOW_TO_ADD}")


@dataclass(frozen=True)
class Block:
    """A layer-level child that takes the hidden states (attention, MLP, linear attention), and how
    the layer calls it."""

    positional: int  # positional arguments in the call (0: hidden_states is passed by keyword)
    edits_in_place: bool = False  # its forward changes tensors in place (OLMo's clamp_ under clip_qkv)
    replicated: bool = False  # no row-parallel projection: runs whole on every rank (linear attention)


@dataclass(frozen=True)
class Mixer:
    """One kind of a layer-level block whose kind changes by layer (Nemotron-H's ``mixer``, MiniMax's
    ``self_attn``): how that kind is called and the parameters it runs whole with (replicated)."""

    block: Block
    params: tuple[str, ...] = ()  # its own parameters outside the plan (a block that runs whole)


@dataclass(frozen=True)
class Region:
    """A mixture-of-experts block run as one tensor-parallel region (:class:`hf_tp.moe.expert_styles.MoERegion`)."""

    roles: dict[str, Role] = field(hash=False)  # parameter (relative to the block) -> its placement
    positional: int  # how the layer passes the hidden states, as Block.positional
    routers: tuple[str, ...]  # modules whose logits HF records for the aux loss
    experts: str  # the experts module, relative to the block
    widths: tuple[tuple[str, int], ...]  # (parameter, features tp splits)
    aux_exact: bool  # every router hands out its logits apart from the routing (see MoERegion)
    output_norm: str = ""  # a norm the block applies to its combined output (the region ends at its input)


@dataclass(frozen=True)
class Derivation:
    """What the generic plan needs, read off one model: module paths relative to the layer or model."""

    model_type: str
    layers_path: str
    colwise: tuple[str, ...]
    kv: tuple[str, ...]  # colwise K/V projections (replicated when tp > num_key_value_heads)
    kv_bound: tuple[str, ...]  # sharded projections that split the KV heads (K/V, or packed QKV)
    rowwise: tuple[str, ...]
    # transformers' colwise_gather_output / rowwise_split_input (packed qkv_proj, gate_up_proj):
    # the projection is sharded, its output all-gathered, the region between runs whole on every
    # rank, and the row-parallel projection takes its own slice of the input again.
    gathered: tuple[str, ...]
    head_norms: tuple[str, ...]
    width_norms: tuple[str, ...]  # norms over a whole column-parallel output (all heads)
    head_params: dict[str, tuple[str, ...]] = field(hash=False)  # block -> its own per-head parameters (sinks)
    region_params: dict[str, tuple[str, ...]] = field(hash=False)  # module -> own parameters in a replicated block
    activations: tuple[str, ...]  # elementwise activations with learned scalars, on column-parallel outputs
    layer_norms: tuple[str, ...]
    layer_linears: tuple[str, ...]  # Linears the layer calls itself, per token (replicated, on sequence shards)
    blocks: dict[str, Block] = field(hash=False)
    regions: dict[str, Region] = field(hash=False, default_factory=dict)  # MoE blocks
    embedding: str = ""
    embedding_norm: str = ""  # a norm child the embedding applies to its lookup (relative to it)
    top_norms: tuple[str, ...] = ()  # norms outside the layers (sequence parallel), model-relative
    top_embeddings: tuple[str, ...] = ()  # further token embeddings (vocab-sharded as the input one)
    # position embeddings that compute their own positions (OPT's learned ones, from the attention
    # mask; XGLM's sinusoid table): whole on every rank, their output handed on as sequence shards
    top_positions: tuple[str, ...] = ()
    top_position_weights: tuple[str, ...] = ()  # those of them with a learned weight (replicated)
    top_linears: tuple[str, ...] = ()  # per-token Linears outside the layers (replicated, sequence parallel)
    lm_head: str = ""
    plain_lm_head: bool = False
    widths: tuple[tuple[str, int], ...] = ()  # (module, features tp splits) for the divisibility check
    kv_vary: bool = False  # layer kinds differ in their K/V heads (no replication across tp ranks)
    # hyper-connections: modules mixing the residual's streams per token (replicated, on sequence shards)
    layer_mixers: tuple[str, ...] = ()
    top_mixers: tuple[str, ...] = ()  # model-relative
    hidden_size: int = 0
    # blocks whose kind changes by layer: path -> module class name -> that kind (the plan's entry
    # chooses per layer; a MoE kind is in ``regions``)
    mixers: dict[str, dict[str, Mixer]] = field(hash=False, default_factory=dict)
    # attention module -> its own head-count attributes its code reshapes with (set to the rank's)
    head_counts: dict[str, tuple[str, ...]] = field(hash=False, default_factory=dict)
    flattening: tuple[str, ...] = ()  # layer classes that run their own MLP on flattened tokens (OPT's)
    plan_source: str = "transformers"  # where the projections' styles come from: "transformers" or "model"
