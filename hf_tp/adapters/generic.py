"""The generic TP+SP plan: derived from a model's own ``base_model_tp_plan`` and its modules.

transformers says, per family, which projections are column- and row-parallel
(``config.base_model_tp_plan``). That is not yet a sequence-parallel plan: hf_tp also needs which
norms sit on the residual stream, how the decoder layer calls each block (so ``PrepareModuleInput``
gathers the right argument), where the embedding, final norm and lm_head are, and whether the
logits are exactly ``lm_head(hidden)``. This module reads those from the model itself (built on the
meta device from the config: no memory, no weights) and from the source of its ``forward``s.

It proves itself or refuses: every parameter of a decoder layer and of the top level must be
placed by a rule below, every block must be called from the layer in a way it can read, and a
style or module it has no rule for (latent attention, experts, parameters on the layer itself,
...) is a ``ValueError`` naming the module and the way out (a hand-written adapter), never a
guessed plan.

The rules, per decoder layer (Megatron's SP layout, as ``adapters/families.py`` writes Llama's by hand):
  - ``colwise`` Linear -> ``ColwiseParallel`` (K/V projections replicated when tp > KV heads);
  - ``rowwise`` Linear -> ``RowwiseParallel`` reduce-scattering to sequence shards (DTensor out);
  - the layer-level child holding them (``self_attn``, ``mlp``, ...) -> ``PrepareModuleInput``
    all-gathering its ``hidden_states`` input, by keyword or position as the layer calls it;
  - a layer-level norm over ``hidden_size`` -> ``SequenceParallel`` (every layer-level tensor is a
    sequence shard, so this holds for pre-, post- and parallel-block norms alike);
  - ``replicated_with_grad_allreduce`` on a ``head_dim`` norm -> the per-head norm style; a norm
    over a whole projection (``width_norm``, from a family's overrides) -> ``WidthNormParallel``;
  - ``colwise_gather_output``/``rowwise_split_input`` (packed qkv/gate_up) and blocks without a
    row-parallel projection (linear attention) run whole on every rank on the gathered sequence,
    their other parameters replicated; a hybrid model's layer kinds share one plan.
Top level: the input embedding vocab-sharded to sequence shards, hidden-size norms of the base
model sequence parallel, the output embedding column-parallel over the vocab.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
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
from hf_tp.adapters.facts import Block, Derivation, Mixer, refuse
from hf_tp.adapters.families import TP_DIVISORS, base_tp_plan
from hf_tp.adapters.inspect_model import inspect_model
from hf_tp.adapters.inspect_plan import model_tp_plan
from hf_tp.adapters.text_tower import causal_lm_from_config
from hf_tp.compat.torch_fake import unset_fake_temporarily
from hf_tp.core.forward_source import AS_CALLED
from hf_tp.moe.expert_styles import DenseOrMoE, MoERegion
from hf_tp.styles import (
    ByKind,
    ColwiseGatherIn,
    ColwiseOwnOutput,
    Compose,
    GatherAsCalled,
    HyperConnectionLayer,
    HyperConnectionOnShards,
    LocalHeadCounts,
    LocalHeadParams,
    LocalParamViews,
    PerTokenOnShards,
    PositionsToSequenceShards,
    ReplicatedKVProjection,
    ReplicatedToSequenceShards,
    ScaledEmbeddingRowwise,
    StreamShape,
    WidthNormParallel,
    head_norm,
)

_DERIVED: dict[str, Derivation] = {}  # config JSON -> derivation (building the meta model costs ~0.1-2 s)
_DERIVING = threading.Lock()


def generic_adapter(config: PretrainedConfig) -> Adapter:
    """The :class:`Adapter` derived from ``config``'s model (cached per config)."""
    key = config.to_json_string(use_diff=False)
    # One derivation at a time: building the meta model sets torch's process-wide default dtype for
    # a while, and two threads (ranks of an in-process group) interleaving that would leave it wrong.
    with _DERIVING:
        if key not in _DERIVED:
            _DERIVED[key] = derive(config)
    d = _DERIVED[key]
    # tp and the KV heads must fit each other only where the plan splits the KV heads; attention
    # that runs whole (transformers gathers it, or has no plan for it) leaves them alone.
    fields = ("num_attention_heads", "num_key_value_heads") if d.kv_bound else ("num_attention_heads",)
    split = tuple(f for f in fields if getattr(config, f, None) is not None)
    return Adapter(
        model_type=d.model_type,
        layer_plan=lambda opts: layer_plan(d, opts),
        top_plan=lambda opts: top_plan(d, opts),
        layers_path=d.layers_path,
        split_fields=split,
        check=lambda cfg, tp: _check_widths(d, cfg, tp),
        plain_lm_head=d.plain_lm_head,
        read_from_modules=d.plan_source == "model",
        local_token_reshapes=bool(d.flattening),
        moe=bool(d.regions),
        experts=tuple(sorted(f"{b}.{r.experts}" if r.experts else b for b, r in d.regions.items())),
        # experts the layer calls itself, or an MLP it runs on its flattened tokens
        flattens_tokens=any(not r.experts for r in d.regions.values()) or bool(d.flattening),
    )


def layer_plan(d: Derivation, opts: PlanOptions) -> Plan:
    """One decoder layer's plan (see the module docstring for the rules)."""
    plan: Plan = {}
    kv_style = ReplicatedKVProjection(opts.kv_replicas) if opts.kv_replicas > 1 else None
    out = dict(output_layouts=Shard(1), use_local_output=False) if opts.sequence_parallel else {}
    for path in d.colwise:
        if path not in d.blocks and "." not in path:  # the layer's own MLP: the up projection gathers its input
            plan[path] = ColwiseGatherIn() if opts.sequence_parallel else ColwiseParallel()
            continue
        own = d.blocks[path.split(".", 1)[0]].edits_in_place
        if path in d.gathered:
            plan[path] = ColwiseParallel(output_layouts=Replicate())
        else:
            plan[path] = (kv_style if path in d.kv else None) or (ColwiseOwnOutput() if own else ColwiseParallel())
    for path in d.rowwise:
        if "." not in path and d.flattening and opts.sequence_parallel:
            # the layer's own MLP on its flattened tokens (a strided shard of them): all-reduced whole, the
            # residual add takes the rank's rows (a reduce-scatter to Shard(1) would split the features)
            plan[path] = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
            continue
        plan[path] = RowwiseParallel(input_layouts=Replicate(), **out) if path in d.gathered else RowwiseParallel(**out)
    for path in d.head_norms:
        plan[path] = head_norm()
    for path in d.width_norms:
        plan[path] = WidthNormParallel()
    for path in d.activations:
        plan[path] = SequenceParallel(sequence_dim=-1, use_local_output=True)  # replicated scalars, Partial grads
    if opts.sequence_parallel:
        for path in d.layer_norms:
            plan[path] = SequenceParallel()
        for path in d.layer_linears:
            plan[path] = PerTokenOnShards()
        for path, block in d.blocks.items():
            if path not in d.mixers:
                plan[path] = _block_style(block)
    for path, kinds in d.mixers.items():  # a block whose kind changes by layer: each kind's plan
        plan[path] = ByKind({cls: _mixer_style(m, opts) for cls, m in kinds.items()})
    for path, names in d.region_params.items():
        own = LocalParamViews(names, Replicate())
        plan[path] = Compose(plan[path], own) if path in plan else own
    for path, region in d.regions.items():
        moe = MoERegion(region.roles, region.positional, region.routers, opts.sequence_parallel, region.output_norm)
        plan[path] = DenseOrMoE(plan.get(path), moe, region.experts) if path in d.blocks else moe
        if region.output_norm and opts.sequence_parallel:  # on the region's summed output's sequence shards
            plan[f"{path}.{region.output_norm}"] = SequenceParallel()
    for path, names in d.head_params.items():
        own = LocalHeadParams(names)
        plan[path] = Compose(plan[path], own) if path in plan else own
    for path, names in d.head_counts.items():
        counts = LocalHeadCounts(names)
        plan[path] = Compose(plan[path], counts) if path in plan else counts
    plan = dict(sorted(plan.items()))
    if opts.sequence_parallel and d.layer_mixers:  # hyper-connections: the layer itself last (its hooks run last)
        stream = StreamShape(d.hidden_size)
        plan.update({path: HyperConnectionOnShards(stream) for path in d.layer_mixers})
        plan[""] = HyperConnectionLayer(stream, tuple(sorted({*d.blocks, *d.regions})))
    return plan


def _block_style(block: Block) -> ParallelStyle:
    """A block's entry: its input gathered; a replicated block's output handed back as shards."""
    return Compose(_gather_input(block), ReplicatedToSequenceShards()) if block.replicated else _gather_input(block)


def _mixer_style(mixer: Mixer, opts: PlanOptions) -> ParallelStyle | None:
    """One kind of a per-layer mixer: as its block (under SP), its own parameters replicated."""
    styles = [_block_style(mixer.block)] if opts.sequence_parallel else []
    styles += [LocalParamViews(mixer.params, Replicate())] if mixer.params else []
    return Compose(*styles) if len(styles) > 1 else next(iter(styles), None)


def _gather_input(block: Block) -> PrepareModuleInput:
    """All-gather the block's hidden-states input from sequence shards (the other inputs pass); a
    replicated block gets it as a plain tensor (its code mixes it with plain tensors)."""
    local = block.replicated
    if block.positional == AS_CALLED:  # the layer's calls differ (by layer kind)
        return GatherAsCalled(use_local_output=local)
    if block.positional == 0:
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=local,
        )
    rest = (None,) * (block.positional - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=local
    )


def top_plan(d: Derivation, opts: PlanOptions) -> Plan:
    """Embedding (vocab-sharded rows, scaled after the reduction if the model scales it), the base
    model's norms and the lm_head (vocab-sharded columns)."""
    seq = Shard(1) if opts.sequence_parallel else Replicate()
    plan: Plan = {
        d.embedding: ScaledEmbeddingRowwise(
            input_layouts=Replicate(),
            output_layouts=seq,
            use_local_output=not opts.sequence_parallel,
            output_norm=d.embedding_norm,
        ),
    }
    if opts.loss_parallel:
        plan[d.lm_head] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    else:
        plan[d.lm_head] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    for path in d.top_embeddings:  # Gemma 4's per-layer embeddings: the input embedding's split
        plan[path] = ScaledEmbeddingRowwise(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not opts.sequence_parallel
        )
    for path in d.top_positions:  # whole on every rank (a replicated weight, if any), handed on as sequence shards
        styles = [LocalParamViews(("weight",), Replicate())] if path in d.top_position_weights else []
        styles += [PositionsToSequenceShards()] if opts.sequence_parallel else []
        if styles:
            plan[path] = Compose(*styles) if len(styles) > 1 else styles[0]
    if opts.sequence_parallel:
        for path in d.top_norms:
            plan[path] = SequenceParallel()
        for path in d.top_linears:  # per token: replicated weights on sequence shards
            plan[path] = PerTokenOnShards()
        for path in d.top_mixers:
            plan[path] = HyperConnectionOnShards()
    return plan


def _check_widths(d: Derivation, config: PretrainedConfig, tp: int) -> None:
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and tp > kv and d.kv_bound and not d.kv:
        raise ValueError(
            f"tp must divide num_key_value_heads ({kv}) of this {d.model_type} model, got tp={tp}: its packed "
            f"{', '.join(d.kv_bound)} cannot give each KV head to several ranks; use tp <= {kv}"
        )
    if d.kv_vary and kv is not None and tp > kv:
        raise ValueError(
            f"tp ({tp}) is over num_key_value_heads ({kv}) of this {d.model_type} model, whose layers differ in their "
            f"K/V heads ({', '.join(d.kv)} change width by layer), so no layer may share a KV head: use tp <= {kv}"
        )
    if d.width_norms and kv is not None and tp > kv:
        raise ValueError(
            f"tp ({tp}) is over num_key_value_heads ({kv}) of this {d.model_type} model, whose norms over the "
            f"whole k projection ({', '.join(d.width_norms)}) need every KV head sharded: use tp <= {kv}"
        )
    if (
        d.regions
        and not all(r.aux_exact for r in d.regions.values())
        and getattr(config, "output_router_logits", False)
    ):
        raise ValueError(
            f"this {d.model_type} model's router returns the logits it routes with, so hf_tp cannot give its "
            "load-balancing loss the right gradient under tp > 1: set config.output_router_logits=False"
        )
    if d.model_type in TP_DIVISORS and TP_DIVISORS[d.model_type][1] % tp:
        what, n = TP_DIVISORS[d.model_type]
        valid = ", ".join(str(t) for t in range(1, n + 1) if n % t == 0)
        raise ValueError(f"tp must divide {n}, the {what} in {d.model_type} models, got tp={tp}; use tp in {valid}")
    for path, width in d.widths:
        if width % tp:
            valid = ", ".join(str(t) for t in range(1, width + 1) if width % t == 0 and t <= 64)
            raise ValueError(
                f"tp must divide the {width} features that {path} splits in this {d.model_type} model, got tp={tp}; "
                f"valid tp values for it include: {valid}"
            )


def derive(config: PretrainedConfig) -> Derivation:
    """Read the plan's facts off ``config``'s causal-LM model, built on the meta device."""
    mt = config.model_type
    tp_plan = base_tp_plan(config)
    # outside any fake-tensor mode (hf-tp estimate's): building reads real scalars (Gemma 4's layer scalars)
    with unset_fake_temporarily(), torch.device("meta"):
        try:
            model = causal_lm_from_config(config)
        except Exception as exc:  # noqa: BLE001 - any failure to build means no derivation
            raise refuse(mt, f"its model could not be built from the config ({type(exc).__name__}: {exc})") from None
    try:
        if tp_plan:
            return inspect_model(model, tp_plan)
        # transformers has no tp plan for it: the projections' styles read from the model itself
        return replace(inspect_model(model, model_tp_plan(model)), plan_source="model")
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model the reading does not understand is refused, not crashed on
        raise refuse(
            mt, f"reading its modules failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        ) from None
