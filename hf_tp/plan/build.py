"""``hf_tp.plan_for``: the TP+SP plan of a model, derived as ``hf_tp.parallelize`` derives it,
described without applying it (no mesh, no process group, no weights: a meta-device model).

It describes what :func:`hf_tp.prepare` decides (the adapter, plan options, the plan's origin)
after ``hf-tp train``'s config checks (:func:`hf_tp.run.validate.validate_model_config`): the
same checks as parallelize, in its order, so a model and layout they refuse is refused here with
the same one-line message.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_tp.adapters.adapter import Adapter
from hf_tp.adapters.families import base_tp_plan
from hf_tp.adapters.support import GENERIC, MOE, TEXT_TOWERS
from hf_tp.core.dims import ParallelDims, check_positive
from hf_tp.core.model_source import ModelSource
from hf_tp.core.module_queries import experts_per_token
from hf_tp.core.record import record_of
from hf_tp.parallel.prepare import Prepared, prepare
from hf_tp.plan.collectives import Sizes, keep, top_collectives
from hf_tp.plan.layers import Context, describe_layer, group_layers
from hf_tp.plan.model_plan import ModelPlan
from hf_tp.plan.top import describe_top


def plan_for(
    model_or_config: nn.Module | PretrainedConfig | str,
    tp: int | ParallelDims = 2,
    *,
    ep: int = 1,
    cp: int = 1,
    seq_len: int = 2048,
    batch_size: int = 1,
    name: str | None = None,
) -> ModelPlan:
    """The plan ``hf_tp.parallelize`` applies to this model at ``tp`` (with ``ep``/``cp``), described:
    per distinct decoder-layer kind and the top level, each module's style and shard shapes, the
    share of weights tp splits, why parts run whole, and the collectives of one forward and
    backward of ``batch_size`` rows of ``seq_len`` tokens. Takes a model (not yet parallelized),
    a config, or what ``hf-tp plan --model`` takes (bundled name, local folder, cached Hub id).
    ``tp`` may be a :class:`hf_tp.ParallelDims` (its tp, ep and cp; then ``ep``/``cp`` stay 1).
    Raises ``ValueError`` (one line) for a model or layout hf_tp refuses."""
    from hf_tp.run.validate import validate_model_config

    if isinstance(tp, ParallelDims):
        if (ep, cp) != (1, 1):
            raise ValueError("plan_for takes ep and cp once: in the ParallelDims, or as ep=/cp= with an int tp")
        tp, ep, cp = tp.tp, tp.ep, tp.cp
    for dim, value in (("tp", tp), ("ep", ep), ("cp", cp), ("seq_len", seq_len), ("batch_size", batch_size)):
        check_positive(dim, value, flags=True)
    model, config, label = _resolve(model_or_config)
    validate_model_config(config, tp, seq_len, ep=ep)
    if model is None:
        with torch.device("meta"):  # shapes only, as parallelize would get it
            model = ModelSource(config).build()
    # parallelize's own checks and plan at these sizes (dp = ep: ranks enough for ep to borrow)
    prepared = prepare(model, ParallelDims(tp=tp, dp=ep, cp=cp, ep=ep))
    text = prepared.adapter.layers_config(config)
    multiple = prepared.dims.row_multiple  # training pads rows to this multiple
    padded = -(-seq_len // multiple) * multiple
    dtype = _dtype(text, config)
    sizes = Sizes(batch_size * padded // cp, text.hidden_size, dtype.itemsize, tp, cp, ep, _top_k(text))
    header = dict(model=name or label or config.model_type, seq_len=padded, batch_size=batch_size)
    return _describe(prepared, text, sizes, dtype=str(dtype).removeprefix("torch."), **header)


def _describe(prepared: Prepared, text: PretrainedConfig, sizes: Sizes, **header) -> ModelPlan:
    """Describe every layer of the prepared model, group them, and add the top level and the notes
    (``header``: the model's name, its padded sequence length, batch size and dtype)."""
    hf_model, adapter, opts = prepared.model, prepared.adapter, prepared.opts
    heads = text.num_attention_heads
    tp_plan = {k.split(".*.", 1)[1]: v for k, v in base_tp_plan(text).items() if ".*." in k}
    kv = getattr(text, "num_key_value_heads", None) or heads
    ctx = Context(sizes, tp_plan, kv, heads, tuple(adapter.experts))
    plan = adapter.layer_plan(opts)
    layers = hf_model.get_submodule(adapter.layers_path)
    described = [describe_layer(layer, plan, ctx) for layer in layers]
    labels = [_label(text, i, d.moe, adapter.moe) for i, d in enumerate(described)]
    dims = {"tp": sizes.tp, "cp": sizes.cp, "ep": sizes.ep}
    kinds = [
        replace(kind, forward=keep(kind.forward, dims), backward=keep(kind.backward, dims))
        for kind in group_layers(described, labels)
    ]
    top_rows, top_kinds, top_partial = describe_top(hf_model, adapter, adapter.top_plan(opts), ctx)
    fwd, bwd = top_collectives(top_kinds, sizes, top_partial + sum(d.partial for d in described))
    mt = hf_model.config.model_type
    return ModelPlan(
        **header,
        model_type=mt,
        adapter=prepared.origin,
        note=GENERIC.get(text.model_type) or MOE.get(text.model_type) or TEXT_TOWERS.get(text.model_type) or "",
        tp=sizes.tp,
        ep=sizes.ep,
        cp=sizes.cp,
        layers_path=adapter.layers_path,
        kinds=tuple(kinds),
        top=top_rows,
        top_forward=keep(fwd, dims),
        top_backward=keep(bwd, dims),
        notes=_notes(adapter, sizes, kv),
    )


def _resolve(given) -> tuple[nn.Module | None, PretrainedConfig, str]:
    """(model to read, or None to build one on meta; its config; a label)."""
    source = ModelSource.for_shapes(given)
    model = source.module
    if model is not None and record_of(model) is not None:  # parallelized: its shapes are no longer the plan's input
        model = None
    return model, source.config, source.name


def _dtype(text: PretrainedConfig, config: PretrainedConfig) -> torch.dtype:
    value = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float32
    value = getattr(torch, value) if isinstance(value, str) else value
    return value if isinstance(value, torch.dtype) else torch.float32


def _top_k(config: PretrainedConfig) -> int:
    return experts_per_token(config) or 1


def _label(config: PretrainedConfig, index: int, moe: bool, moe_model: bool) -> tuple[str, str]:
    """What sets layer ``index`` apart: its layer type and, in a MoE model, dense or MoE."""
    types = getattr(config, "layer_types", None)
    kind = types[index] if isinstance(types, list | tuple) and index < len(types) else ""
    return str(kind), ("MoE" if moe else "dense") if moe_model else ""


def _notes(adapter: Adapter, s: Sizes, kv: int) -> tuple[str, ...]:
    notes = []
    if s.tp == 1:
        notes.append("tp 1: parallelize applies no tensor parallelism; the styles are what tp > 1 applies")
    if s.tp > kv:
        notes.append(
            f"tp {s.tp} > {kv} KV heads: each KV head is computed on {s.tp // kv} ranks (Megatron's replication)"
        )
    if adapter.plain_lm_head:
        notes.append(
            "hf-tp train fuses the lm_head with the loss: one all-gather of 2 fp32 numbers per token "
            "replaces loss parallel's three all-reduces"
        )
    if s.ep > 1:
        notes.append(
            f"ep {s.ep} borrows its ranks from dp x cp (a multiple of {s.ep}); all-to-all sizes assume even routing"
        )
    if s.cp > 1:
        notes.append(f"cp {s.cp}: each rank keeps 2 chunks of every row; tp collectives carry its {s.tokens} tokens")
    return tuple(notes)
