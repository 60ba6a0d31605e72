"""Apply an adapter's TP(+SP) plans to a model with ``parallelize_module``."""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from hf_tp.adapters.adapter import Adapter, PlanOptions
from hf_tp.core.module_queries import has_submodule
from hf_tp.core.record import facts_of
from hf_tp.dropout.dropout_install import install_model_dropout
from hf_tp.moe.expert_styles import mark_packed
from hf_tp.multimodal.deepstack import shard_deepstack
from hf_tp.multimodal.passengers import split_at_language_model
from hf_tp.parallel.flat_tokens import keep_token_reshapes_local
from hf_tp.parallel.one_token import gather_one_token_steps
from hf_tp.styles import ReplicatedKVProjection, set_local_kv_groups


def embeddings_tied(model: nn.Module) -> bool:
    """True if the input and output embeddings share one Parameter."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_out() is None:
        return False
    weight = getattr(get_in(), "weight", None)  # a pipeline stage's gap has none (hf_tp.pipeline.pipeline_split)
    return weight is not None and weight is getattr(get_out(), "weight", None)


def check_plan_paths(model: nn.Module, adapter: Adapter, opts: PlanOptions) -> None:
    """Every module a plan names must exist, so a wrong model class fails here and not in torch."""
    try:
        layers = model.get_submodule(adapter.layers_path)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers at '{adapter.layers_path}'; "
            f"hf_tp.parallelize expects a *ForCausalLM model (e.g. from AutoModelForCausalLM)"
        )
    missing = [p for p in adapter.top_plan(opts) if not has_submodule(model, p)]
    # Hybrid models mix layer kinds: a layer-plan entry must exist in some layer (each gets its own).
    # A pipeline stage's layers are some of them, the others gaps: its kinds are checked on the whole
    # model before the cut (hf_tp.pipeline.pipeline_build), a MoE's first dense layers on one stage only.
    if getattr(facts_of(model), "stage", None) is None:
        missing += [
            f"{adapter.layers_path}.*.{p}"
            for p in adapter.layer_plan(opts)
            if not any(has_submodule(x, p) for x in layers)
        ]
    if missing:
        raise ValueError(
            f"the {adapter.model_type} adapter names modules that {type(model).__name__} lacks: "
            f"{', '.join(missing)}; hf_tp.parallelize expects a *ForCausalLM model"
        )


def _check_all_placed(model: nn.Module, adapter: Adapter) -> None:
    """Under SP every parameter must be a DTensor: a plain one in a sharded region would train on
    one rank's share of its gradient (silently wrong), so an incomplete plan is an error. A
    wrapper's passengers (vision tower, projector) never see the sharded stream: they stay whole."""
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) and not adapter.is_passenger(n)]
    if plain:
        raise ValueError(
            f"the {adapter.model_type} adapter's plan leaves {len(plain)} parameters without a placement "
            f"({', '.join(plain[:4])}); their gradients would cover one tp rank's share only: add them to its plan"
        )


def apply_tensor_parallel(model: nn.Module, adapter: Adapter, tp_mesh: DeviceMesh, opts: PlanOptions) -> None:
    """Shard every decoder layer and the top-level modules over ``tp_mesh``, in place."""
    tied = embeddings_tied(model)
    config = adapter.layers_config(model.config)
    layer_plan = adapter.layer_plan(opts)
    replicated_kv = [p for p, s in layer_plan.items() if isinstance(s, ReplicatedKVProjection)]
    if opts.kv_replicas > 1 and not replicated_kv:
        raise ValueError(
            f"the {adapter.model_type} adapter's plan does not replicate KV heads, so tp ({tp_mesh.size()}) must "
            f"divide num_key_value_heads ({config.num_key_value_heads})"
        )
    for layer in model.get_submodule(adapter.layers_path):
        # the attentions of this layer (a per-layer mixer is attention in some layers only); raises
        # before the first layer is touched
        for attention in {p.rpartition(".")[0] for p in replicated_kv if has_submodule(layer, p)}:
            set_local_kv_groups(layer.get_submodule(attention), config.num_attention_heads, tp_mesh.size())
        parallelize_module(layer, tp_mesh, {p: style for p, style in layer_plan.items() if has_submodule(layer, p)})
        if adapter.local_token_reshapes:  # (before the one-token gather: its mode then runs first)
            keep_token_reshapes_local(layer)
        if adapter.flattens_tokens:
            gather_one_token_steps(layer)
    parallelize_module(model, tp_mesh, _top_plan_of(model, adapter, opts))
    if tied:
        # parallelize_module replaced both weights with separate DTensor Parameters; training two
        # copies silently diverges from HF, so point lm_head back at the embedding's Parameter
        # (a first pipeline stage's lm_head gap holds the tied weight without a plan of its own).
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if opts.sequence_parallel:
        _check_all_placed(model, adapter)
    if adapter.language_model and opts.sequence_parallel:
        split_at_language_model(model, adapter, tp_mesh)  # a wrapper: after its image features merged in
        shard_deepstack(model.get_submodule(adapter.language_model))  # Qwen3-VL's features in early layers
    install_model_dropout(model, adapter, opts, tp_mesh)  # the model's own dropout: masks right under tp
    _say_if_mostly_whole(model, adapter, tp_mesh.size())


def _top_plan_of(model: nn.Module, adapter: Adapter, opts: PlanOptions) -> dict:
    """The adapter's plan for the modules outside the layers, less those a pipeline stage leaves
    to other stages (parameter-less gaps: the embedding after the first stage, the final norm and
    lm_head before the last; :mod:`hf_tp.pipeline.pipeline_split`)."""
    stage = getattr(facts_of(model), "stage", None)
    gaps = stage.gaps if stage is not None else ()
    return {path: style for path, style in adapter.top_plan(opts).items() if path not in gaps}


def mark_packed_experts(model: nn.Module, adapter: Adapter, opts: PlanOptions) -> None:
    """Record which expert weights a tp > 1 mesh stores as packed gate/up halves (at any tp,
    before any style is applied), so a checkpoint writes them in that layout on every mesh."""
    plan = adapter.layer_plan(opts)
    for layer in model.get_submodule(adapter.layers_path):
        for path, style in plan.items():
            if has_submodule(layer, path):
                mark_packed(style, layer.get_submodule(path))


MOSTLY_WHOLE = 0.25  # below this share of sharded decoder-layer weights tp hardly splits the model


def sharded_share(model: nn.Module, layers_path: str) -> float:
    """The share of the decoder layers' weight elements that tensor parallelism splits (a
    ``Shard`` placement); the rest runs whole on every tp rank."""
    total = split = 0
    for p in model.get_submodule(layers_path).parameters():
        total += p.numel()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            split += p.numel()
    return split / total if total else 1.0


def _say_if_mostly_whole(model: nn.Module, adapter: Adapter, tp: int) -> None:
    """One warning (rank 0) when the plan leaves most of the layers whole: the run is exact but
    tp then buys little memory or speed, which a user would not guess from a run that works."""
    share = sharded_share(model, adapter.layers_path)
    if share < MOSTLY_WHOLE and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(
            f"hf_tp: tp={tp} splits only {100 * share:.0f}% of {adapter.model_type}'s decoder-layer weights; the "
            "rest runs whole on every tp rank, so memory and time hardly fall with tp (prefer dp/FSDP2 for it)",
            stacklevel=3,
        )
