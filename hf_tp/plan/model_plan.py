"""The typed record of a derived plan: what ``hf_tp.plan_for`` returns and ``hf-tp plan`` prints.

Plain data (no torch), so a caller can keep, compare or serialise it (``to_dict``). Shapes are
per parameter as transformers stores it; ``local`` is rank 0's share (the first ranks take one
more row when a size does not divide).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ParamShard:
    """One parameter: its full shape and the shape one rank keeps."""

    name: str  # relative to the module of its row
    shape: tuple[int, ...]
    local: tuple[int, ...]
    split: bool  # tp splits it (a Shard placement over tp)
    partial_grad: bool = False  # replicated over tp, its gradient a partial sum (the fused all-reduce)
    placed: bool = True  # False: no plan entry places it (parallelize refuses such a plan)
    packed: bool = False  # two halves (gate | up) along the split dim, each split


@dataclass(frozen=True)
class ModuleRow:
    """One module of a decoder layer (path relative to the layer) or of the top level."""

    path: str
    style: str  # the plan's style in words
    params: tuple[ParamShard, ...] = ()
    whole: str = ""  # why it runs whole on every rank, when it does


@dataclass(frozen=True)
class Collective:
    """One collective of a forward or a backward, sized as ``hf_tp.estimate.counters`` counts them:
    ``nbytes`` is the full-size buffer (an all-gather's output, a reduce-scatter's input)."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    dim: str  # the mesh dim it runs over: tp, cp or ep
    where: str
    elements: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize


@dataclass(frozen=True)
class LayerKind:
    """Decoder layers whose plans are equal, described once."""

    layers: tuple[int, ...]
    label: str  # "MoE", "sliding_attention", ... ("" when there is one kind)
    rows: tuple[ModuleRow, ...]
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    total: int  # weight elements of one layer
    split: int  # of which tp splits
    per_rank: int  # what one rank keeps

    @property
    def split_share(self) -> float:
        return self.split / self.total if self.total else 1.0


@dataclass(frozen=True)
class ModelPlan:
    """The TP+SP plan hf_tp derives for a model, at one layout and sequence length."""

    model: str
    model_type: str
    adapter: str  # hand-written | derived | multimodal wrapper of ...
    note: str  # what hf_tp's support table says of the family
    tp: int
    ep: int
    cp: int
    seq_len: int  # padded as training pads rows
    batch_size: int
    dtype: str
    layers_path: str
    kinds: tuple[LayerKind, ...]
    top: tuple[ModuleRow, ...]
    top_forward: tuple[Collective, ...]
    top_backward: tuple[Collective, ...]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        """Plain JSON-able data (``hf-tp plan --json``)."""
        return asdict(self)
