"""Custom ``ParallelStyle``s: what torch's Colwise/Rowwise/SequenceParallel do not cover.

This package sits below :mod:`hf_tp.adapters` (adapters import styles; styles import only torch and
the core), so the family table and the generic plan build from the same pieces. The expert styles
are in :mod:`hf_tp.moe.expert_styles`.
"""

from hf_tp.styles.choice import ByKind, GatherAsCalled, PerLayerChoice, resolve
from hf_tp.styles.embedding import ScaledEmbeddingRowwise
from hf_tp.styles.heads import (
    Compose,
    LocalHeadCounts,
    LocalHeadParams,
    LocalParamViews,
    PositionsToSequenceShards,
    ReplicatedToSequenceShards,
)
from hf_tp.styles.kv_heads import KVHeadLinear, ReplicatedKVProjection, set_local_kv_groups
from hf_tp.styles.linear import ColwiseGatherIn, ColwiseOwnOutput, PerTokenOnShards
from hf_tp.styles.norms import HEADS_DIM, WidthNormParallel, head_norm
from hf_tp.styles.streams import HyperConnectionLayer, HyperConnectionOnShards, StreamShape

__all__ = [
    "ByKind",
    "GatherAsCalled",
    "PerLayerChoice",
    "resolve",
    "ColwiseGatherIn",
    "ColwiseOwnOutput",
    "Compose",
    "LocalHeadCounts",
    "LocalHeadParams",
    "LocalParamViews",
    "PerTokenOnShards",
    "PositionsToSequenceShards",
    "ReplicatedToSequenceShards",
    "HEADS_DIM",
    "HyperConnectionLayer",
    "HyperConnectionOnShards",
    "StreamShape",
    "KVHeadLinear",
    "ReplicatedKVProjection",
    "ScaledEmbeddingRowwise",
    "WidthNormParallel",
    "head_norm",
    "set_local_kv_groups",
]
