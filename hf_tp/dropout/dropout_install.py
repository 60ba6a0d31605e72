"""Install :class:`~hf_tp.dropout.model_dropout.ModelDropout` on a parallelized model whose config
or modules ask for dropout: each module of the plan gets its region kind (see that module)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from hf_tp.adapters.adapter import Adapter, PlanOptions
from hf_tp.core.module_queries import has_submodule
from hf_tp.core.record import record_of
from hf_tp.dropout.model_dropout import REPLICATE, SHARD, ModelDropout
from hf_tp.dropout.tp_dropout import ShardAwareDropout
from hf_tp.moe.expert_styles import DenseOrMoE, MoERegion
from hf_tp.styles.choice import resolve
from hf_tp.styles.heads import Compose, LocalParamViews, ReplicatedToSequenceShards
from hf_tp.styles.kv_heads import ReplicatedKVProjection


def dropout_probabilities(model: nn.Module) -> dict[str, float]:
    """The model's own dropout probabilities > 0: config fields named ``*dropout*`` / ``*pdrop*``
    and ``nn.Dropout`` modules (LoRA's own dropouts excluded: they have their streams)."""
    config = model.config.to_dict() if hasattr(model, "config") else {}
    found = {
        k: float(v)
        for k, v in config.items()
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and 0.0 < v < 1.0
    }
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout) and not isinstance(m, ShardAwareDropout) and m.p > 0 and ".lora_" not in name:
            found[name] = m.p
    return found


def runs_whole(style: ParallelStyle) -> bool:
    """Whether ``style`` runs its module whole on every tp rank (a whole-run region: Mamba mixers,
    DeepSeek's MLA attention; every rank computes the same values from the gathered sequence)."""
    if isinstance(style, Compose):
        return any(runs_whole(s) for s in style.styles)
    if isinstance(style, LocalParamViews):
        return style.placement.is_replicate()
    return isinstance(style, ReplicatedToSequenceShards)


def _replicated(style: ParallelStyle) -> bool:
    """A MoE region or a whole-run region: it runs on the gathered sequence."""
    if isinstance(style, Compose):
        return any(_replicated(s) for s in style.styles)
    return isinstance(style, (MoERegion, DenseOrMoE)) or runs_whole(style)


def region_kinds(plan: dict[str, ParallelStyle], sequence_parallel: bool) -> dict[str, str]:
    """Module path (relative to a decoder layer, "" for the layer) -> region kind: the layer's
    residual stream is sharded under SP; a module whose projections the plan splits (attention,
    MLP) runs on head or feature shards; a MoE or whole-run region on the gathered sequence."""
    kinds = {"": SHARD if sequence_parallel else REPLICATE}
    split = (ColwiseParallel, RowwiseParallel, ReplicatedKVProjection)
    for path, style in plan.items():
        parent = path.rpartition(".")[0]
        if parent and isinstance(style, split) and not (parent in plan and _replicated(plan[parent])):
            kinds.setdefault(parent, SHARD)
    for path, style in plan.items():
        if _replicated(style):
            kinds[path] = REPLICATE
    return kinds


def install_model_dropout(
    model: nn.Module, adapter: Adapter, opts: PlanOptions, tp_mesh: DeviceMesh
) -> ModelDropout | None:
    """Streams for the model's own dropout (None, and nothing installed, when it has none)."""
    if not dropout_probabilities(model):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = tp_mesh.mesh.tolist()  # (tolist, not tensor ops: also answers inside hf-tp estimate's fake mode)
    while isinstance(first, list):
        first = first[0]
    streams = ModelDropout(torch.initial_seed(), rank, int(first))
    plan = adapter.layer_plan(opts)
    _region(model, streams, SHARD if opts.sequence_parallel else REPLICATE, lambda: False)  # embedding dropout
    for layer in model.get_submodule(adapter.layers_path):
        # this layer's plan: per-layer choices (dense or MoE, a mixer's kind) made for its modules
        mine = {p: resolve(s, layer.get_submodule(p)) for p, s in plan.items() if has_submodule(layer, p)}
        kinds = region_kinds({p: s for p, s in mine.items() if s is not None}, opts.sequence_parallel)
        rows = [
            p for p, s in mine.items() if isinstance(s, RowwiseParallel) and kinds.get(p.rpartition(".")[0]) == SHARD
        ]
        checkpointed = _checkpointed(layer)
        for path, kind in kinds.items():
            try:
                module = layer.get_submodule(path) if path else layer
            except AttributeError:
                continue
            _region(module, streams, kind, checkpointed)
        residual = kinds[""]
        for path in rows:  # after a row-parallel projection: its reduced output, on sequence shards or whole
            layer.get_submodule(path).register_forward_hook(lambda *_, kind=residual: streams.set_kind(kind))
    record = record_of(model)
    if record is not None:
        record.dropout = streams
    return streams


def _checkpointed(layer: nn.Module):
    return lambda: bool(getattr(layer, "gradient_checkpointing", False))


def _region(module: nn.Module, streams: ModelDropout, kind: str, checkpointed) -> None:
    """Region hooks, active in training mode only (eval and generate draw no masks and pay
    nothing for the interception)."""

    def enter(mod: nn.Module, args) -> None:
        if mod.training:
            streams.enter(mod, kind, checkpointed())

    def leave(mod: nn.Module, args, out) -> None:
        if mod.training:
            streams.leave()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
