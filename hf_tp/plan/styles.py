"""A plan's ``ParallelStyle`` objects in words, and where each places the parameters it owns.

Read off the style objects an adapter returns (torch's and :mod:`hf_tp.styles`), never applied:
no mesh, no process group. Each style becomes one or more :class:`Part` (a ``Compose`` is its
styles in order; a per-layer choice (``DenseOrMoE``, ``ByKind``) is the style the given layer's block gets), and each part says
where the parameters under its module go (:func:`placements`). A style this module does not
know (a user's own) is described by its class name and places nothing it can name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from hf_tp.core.module_queries import has_parameter
from hf_tp.moe.expert_styles import MoERegion
from hf_tp.styles import (
    ColwiseGatherIn,
    ColwiseOwnOutput,
    Compose,
    HyperConnectionLayer,
    HyperConnectionOnShards,
    LocalHeadCounts,
    LocalParamViews,
    PerLayerChoice,
    PerTokenOnShards,
    PositionsToSequenceShards,
    ReplicatedKVProjection,
    ReplicatedToSequenceShards,
    ScaledEmbeddingRowwise,
    WidthNormParallel,
    resolve,
)


@dataclass(frozen=True)
class Part:
    """One style's effect on one module, as a kind the collectives and the words are read from."""

    kind: str  # see WORDS; "custom" for a style this module does not know
    words: str
    style: ParallelStyle


@dataclass(frozen=True)
class Placed:
    """Where one parameter goes over tp: split on ``dim`` (None: whole on every rank)."""

    dim: int | None
    words: str
    packed: bool = False  # two halves (gate | up) along dim, each split
    partial: bool = False  # replicated, its gradient a partial sum over tp


PER_TOKEN = ("per_token", "hyper")  # kinds that run a module whole per token, its submodules too

WORDS = {
    "gather_in": "all-gather the sequence in",
    "whole_block": "runs whole on the gathered sequence, output sliced to sequence shards",
    "colwise": "colwise",
    "colwise_own": "colwise (its own output copy: the block edits it in place)",
    "colwise_gathered": "colwise, output all-gathered",
    "colwise_gather_in": "colwise, all-gather the sequence in",
    "rowwise_all_reduce": "rowwise, output all-reduced (the layer adds its rows of the flattened tokens)",
    "head_counts": "its head counts set to the rank's heads",
    "positions": "whole on every rank, output sliced to sequence shards",
    "positions_fixed": "whole on every rank (no weights), output sliced to sequence shards",
    "rowwise": "rowwise, reduce-scatter to sequence shards",
    "rowwise_gathered": "rowwise from the whole input, reduce-scatter to sequence shards",
    "rowwise_plain": "rowwise",
    "embedding": "vocab-parallel embedding, reduce-scatter to sequence shards",
    "embedding_scaled": "vocab-parallel embedding, reduce-scatter to sequence shards, then scaled",
    "lm_head": "colwise over the vocab: all-gather in, vocab-parallel logits",
    "lm_head_gathered": "colwise over the vocab: all-gather in, logits all-gathered",
    "sp_norm": "sequence-parallel norm",
    "head_norm": "per-head norm on the rank's heads",
    "activation": "activation with learned scalars, on the rank's columns",
    "width_norm": "norm over the whole width: weight split, all-reduce of per-token sums",
    "moe": "expert-TP region: all-gather in, reduce-scatter out",
    "per_token": "per token on the rank's sequence shard, weights whole",
    "hyper": "hyper-connection mixer: per token on the rank's sequence shard, weights whole",
    "hyper_layer": "residual streams on the rank's sequence shard (the layer mixes them per token, plain tensors)",
}


def parts(style: ParallelStyle, module: nn.Module) -> list[Part]:
    """The parts ``style`` applies to ``module`` (a ``DenseOrMoE`` resolved for this module)."""
    if isinstance(style, Compose):
        return [p for s in style.styles for p in parts(s, module)]
    if isinstance(style, PerLayerChoice):  # dense or MoE, or a per-layer mixer's kind
        chosen = resolve(style, module)
        return [] if chosen is None else parts(chosen, module)
    kind = _kind(style, module)
    if kind == "kv_replicated":
        return [Part(kind, f"replicated KV heads (x{style.replicas} copies)", style)]
    if kind == "own_params":  # (its parameters carry the words)
        return [Part(kind, "", style)]
    if kind == "custom":
        return [Part(kind, f"{type(style).__name__} (a style hf-tp plan cannot read)", style)]
    return [Part(kind, WORDS[kind], style)] if kind else []


def _kind(style: ParallelStyle, module: nn.Module) -> str:
    """The :data:`WORDS` key of one (non-composite) style on ``module``."""
    if isinstance(style, ReplicatedKVProjection):
        return "kv_replicated"
    if isinstance(style, LocalParamViews):
        return "own_params"
    if isinstance(style, MoERegion):
        return "moe"
    if isinstance(style, WidthNormParallel):
        return "width_norm"
    if isinstance(style, HyperConnectionOnShards):
        return "hyper"
    if isinstance(style, HyperConnectionLayer):
        return "hyper_layer"
    if isinstance(style, PerTokenOnShards):
        return "per_token"
    if isinstance(style, PositionsToSequenceShards):  # (a fixed table passes no gradient back)
        return "positions" if any(p.requires_grad for p in module.parameters()) else "positions_fixed"
    if isinstance(style, ReplicatedToSequenceShards):
        return ""  # part of a whole block (with its PrepareModuleInput)
    if isinstance(style, PrepareModuleInput):
        return "whole_block" if style.use_local_output else "gather_in"
    if isinstance(style, SequenceParallel):
        dim = style.sequence_sharding[0].dim
        return {1: "sp_norm", 2: "head_norm"}.get(dim, "activation")
    if isinstance(style, RowwiseParallel):
        return _rowwise_kind(style, module)
    if isinstance(style, ColwiseGatherIn):
        return "colwise_gather_in"
    if isinstance(style, LocalHeadCounts):
        return "head_counts"
    if isinstance(style, ColwiseParallel):
        out = style.output_layouts[0]
        if isinstance(style.input_layouts[0], Shard):  # the lm_head, on sequence shards
            return "lm_head" if isinstance(out, Shard) else "lm_head_gathered"
        if isinstance(out, Replicate):
            return "colwise_gathered"
        return "colwise_own" if isinstance(style, ColwiseOwnOutput) else "colwise"
    return "custom"


def _rowwise_kind(style: RowwiseParallel, module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        scaled = isinstance(style, ScaledEmbeddingRowwise) and hasattr(module, "embed_scale")
        return "embedding_scaled" if scaled else "embedding"
    if not isinstance(style.output_layouts[0], Shard):
        return "rowwise_plain" if style.use_local_output else "rowwise_all_reduce"
    return "rowwise_gathered" if isinstance(style.input_layouts[0], Replicate) else "rowwise"


def placements(part: Part, module: nn.Module) -> dict[str, Placed]:
    """Parameter name (relative to ``module``) -> where ``part`` puts it."""
    kind, style = part.kind, part.style
    if kind.startswith(("colwise", "lm_head")):
        dim = 1 if isinstance(module, nn.Embedding) else 0
        return {n: Placed(0 if n == "bias" else dim, "") for n, _ in module.named_parameters(recurse=False)}
    if kind.startswith(("rowwise", "embedding")):
        dim = 0 if isinstance(module, nn.Embedding) else 1
        return {n: Placed(None if n == "bias" else dim, "") for n, _ in module.named_parameters(recurse=False)}
    if kind in ("sp_norm", "head_norm", "kv_replicated"):
        return {n: Placed(None, "", partial=True) for n, _ in module.named_parameters()}
    if kind in PER_TOKEN:  # (a router or mixer with its own submodules too)
        return {n: Placed(None, "", partial=True) for n, _ in module.named_parameters()}
    if kind == "activation":  # (DTensor all-reduces each scalar's gradient itself)
        return {n: Placed(None, "") for n, _ in module.named_parameters()}
    if kind == "width_norm":
        return {n: Placed(0, "") for n, _ in module.named_parameters(recurse=False)}
    if kind == "own_params":
        split = isinstance(style.placement, Shard)
        words = "per-head, split with the heads" if split else "replicated (the block runs whole)"
        return {n: Placed(0 if split else None, words) for n in style.names if has_parameter(module, n)}
    if kind == "moe":
        return {n: _role(module, n, r) for n, r in style.roles.items() if has_parameter(module, n)}
    return {}


def _role(module: nn.Module, name: str, role) -> Placed:
    """A MoE region parameter's placement, in words."""
    ndim = module.get_parameter(name).dim()
    if role.kind == "replicate":
        return Placed(None, "replicated router, gradient summed over tp", partial=True)
    if role.kind == "additive":
        return Placed(None, "replicated, each rank adds 1/tp of it", partial=True)
    if ndim == 3:
        words = "expert TP"
    elif ndim == 2:
        words = "colwise in the region" if role.dim == 0 else "rowwise in the region"
    else:
        words = "split with its columns"
    return Placed(role.dim, words, packed=role.packed)
