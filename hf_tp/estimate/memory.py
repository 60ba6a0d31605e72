"""Memory figures of one rank: the breakdown by category, a lighter ``MemTracker``, and what the
mixture-of-experts layers cost (expert weights, routed rows, their activations).

The MoE figures are read from the simulated program, not derived from the config: the weight
bytes from the parameters' local shards after ``hf_tp.parallelize``, the routed rows from the
experts modules' inputs, and the activations from ``MemTracker``'s per-module snapshots.

The step's memory cut into segments at the decoder layers' boundaries: the most each segment held.

A segment runs from one decoder-layer event to the next: a layer's forward starting or ending, its
backward starting or ending, in the forward or inside backward (activation checkpointing's
recompute), plus the optimizer step and what comes before the first layer. The tracker keeps, per
(event, in backward, layer index), the largest total any op of the segment left live and the
breakdown at that moment (:class:`SegmentTracker`). :mod:`hf_tp.estimate.depth` reads them from
two short runs of the model to place the full depth's peak (see that module).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.adapters.inspect_moe import num_experts
from hf_tp.compat.mem_tracker import PeakMemTracker, forward_snapshots
from hf_tp.core.record import facts_of
from hf_tp.estimate.spec import GiB, MiB
from hf_tp.moe.expert_parallel import experts_modules

__all__ = ["GiB", "MemoryBreakdown", "MiB", "MoEStats", "PeakMemTracker", "RoutedRows", "find_experts", "moe_stats"]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by one rank, by what holds them (MemTracker's categories)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    temporary: int = 0
    other: int = 0  # buffers (e.g. rotary tables) and untracked-category tensors

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporary + self.other

    @classmethod
    def from_snapshot(cls, snapshot: dict) -> MemoryBreakdown:
        """Sum a ``MemTracker`` snapshot ``{device: {category: bytes}}`` over devices."""
        sums: dict[str, int] = {}
        for per_device in snapshot.values():
            for key, value in per_device.items():
                name = getattr(key, "value", key)  # _MemRefType members are str enums
                sums[name] = sums.get(name, 0) + int(value)
        return cls(
            parameters=sums.get("Parameter", 0),
            gradients=sums.get("Gradient", 0),
            optimizer=sums.get("Optstate", 0),
            activations=sums.get("Activation", 0),
            temporary=sums.get("Temp", 0),
            other=sums.get("Buffer", 0) + sums.get("Other", 0),
        )

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


EP_DIMS = ("dp_out", "ep", "tp")  # hf_tp.moe.expert_parallel.build_ep_mesh's names

BALANCED_NOTE_LINES = (
    "The ep all-to-alls assume balanced routing: every expert gets the same number of (token, choice)",
    "rows. Real routing is uneven; a hot rank's all-to-all and experts' activations can be larger.",
)


@dataclass(frozen=True)
class MoEStats:
    """One rank's mixture-of-experts figures for one micro-step (per MoE layer unless named)."""

    layers: int  # MoE layers (dense layers mixed in are not counted)
    experts: int  # routed experts of a MoE layer
    experts_per_rank: int  # experts / ep
    top_k: int
    expert_param_bytes: int  # this rank's shards of every MoE layer's expert weights (fp32 master)
    other_param_bytes: int  # this rank's shards of every other weight
    routed_rows: int  # (token, choice) rows entering one MoE layer's experts
    a2a_rows_out: int  # of those, rows sent to other ep ranks (0 at ep=1)
    a2a_rows_in: int  # rows received from other ep ranks for this rank's experts
    activation_bytes: int  # left live by the experts' forwards (saved for backward), all MoE layers
    forward_peak_bytes: int  # the most one experts forward holds above its start (largest layer)
    balanced_routing: bool  # True when ep > 1: the all-to-all rows assume even routing

    def to_dict(self) -> dict:
        return asdict(self)


def find_experts(model: nn.Module, config: PretrainedConfig) -> list[nn.Module]:
    """The experts modules of the model's MoE layers (empty for a dense model)."""
    adapter = get_adapter(config)
    if not adapter.moe:
        return []
    return [m for _, m in experts_modules(model, adapter.layers_path, adapter.experts)]


def ep_mesh_of(experts: list[nn.Module]) -> DeviceMesh | None:
    """The ``("dp_out", "ep", "tp")`` mesh expert parallelism put the expert weights on, if any."""
    for module in experts:
        for param in module.parameters(recurse=False):
            if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == EP_DIMS:
                return param.device_mesh
    return None


def ep_groups(experts: list[nn.Module]) -> dict[str, tuple[str, int]]:
    """Process group name -> (dim, size) for the ep mesh's dims (its tp dim counts as ``tp``)."""
    mesh = ep_mesh_of(experts)
    if mesh is None:
        return {}
    return {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in EP_DIMS}


def _local_bytes(param: torch.Tensor) -> int:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


class RoutedRows:
    """Forward pre-hooks recording each experts call's (token, choice) rows and top-k."""

    def __init__(self, experts: list[nn.Module]) -> None:
        self.rows: list[int] = []
        self.top_k = 0
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in experts]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if len(args) < 2 and "top_k_index" not in kwargs:  # every expert on every token (Llama 4): stacked rows
            self.rows.append(args[0].shape[0])
            self.top_k = getattr(module, "num_experts", 0)
            return
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # (tokens, top_k)
        self.rows.append(index.numel())
        self.top_k = index.shape[-1]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _total(snapshot: dict) -> int:
    return sum(int(per_device.get("Total", 0)) for per_device in snapshot.values())


def moe_stats(
    model: nn.Module, config: PretrainedConfig, experts: list[nn.Module], tracker: PeakMemTracker, routed: RoutedRows
) -> MoEStats:
    """Read the MoE figures after a tracked step (``tracker`` watched ``experts``)."""
    expert_params = {id(p) for m in experts for p in m.parameters()}
    expert_bytes = sum(_local_bytes(p) for m in experts for p in m.parameters())
    other_bytes = sum(_local_bytes(p) for p in model.parameters() if id(p) not in expert_params)
    kept, peak = 0, 0
    for module in experts:
        pre, post, top = forward_snapshots(tracker, module)
        kept += _total(post) - _total(pre)
        peak = max(peak, _total(top) - _total(pre))
    total = num_experts(config) or 0
    shard = getattr(facts_of(experts[0]), "experts", None)
    local = total if shard is None else shard.local
    out_rows, in_rows = (0, 0) if shard is None else shard.a2a_rows
    return MoEStats(
        layers=len(experts),
        experts=total,
        experts_per_rank=local,
        top_k=routed.top_k,
        expert_param_bytes=expert_bytes,
        other_param_bytes=other_bytes,
        routed_rows=routed.rows[0],
        a2a_rows_out=out_rows,
        a2a_rows_in=in_rows,
        activation_bytes=kept,
        forward_peak_bytes=peak,
        balanced_routing=local < total,
    )


SegmentKey = tuple[str, bool, int]
BEGIN: SegmentKey = ("begin", False, -1)  # before the first decoder layer's forward (the embedding)
OPTIMIZER: SegmentKey = ("optimizer", False, -1)  # inside the optimizer's step


def decoder_layers(model: nn.Module, layers_path: str) -> list[nn.Module]:
    """The model's decoder layers at ``layers_path`` (none where it is missing: no segments)."""
    try:
        return list(model.get_submodule(layers_path))
    except AttributeError:
        return []


class SegmentTracker(PeakMemTracker):
    """:class:`PeakMemTracker` that also keeps each segment's largest moment (see the module docstring).

    Segments are keyed ``(event, backward, layer index)``: ``event`` one of ``"fwd_pre"``,
    ``"fwd_post"``, ``"bwd_pre"``, ``"bwd_post"`` of the decoder layer at that index (``backward``:
    the event came while autograd ran backward, i.e. a recompute's forward), :data:`BEGIN` or
    :data:`OPTIMIZER`.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self._layer_index = {id(layer): i for i, layer in enumerate(layers)}
        self._segment: SegmentKey = BEGIN
        self.segments: dict[SegmentKey, tuple[int, dict]] = {}

    def on_module(self, module: nn.Module, event: str, backward: bool) -> None:
        index = self._layer_index.get(id(module)) if module is not None else None
        if index is not None:
            self._segment = (event, backward, index)

    def on_snapshot(self, current: dict, optimizer: bool) -> None:
        total = sum(int(snap.get("Total", 0)) for snap in current.values())
        key = OPTIMIZER if optimizer else self._segment
        held = self.segments.get(key)
        if held is None or held[0] < total:
            self.segments[key] = (total, {device: dict(snap) for device, snap in current.items()})

    def breakdowns(self) -> dict[SegmentKey, MemoryBreakdown]:
        """Each segment's largest moment, by category."""
        return {key: MemoryBreakdown.from_snapshot(snap) for key, (_, snap) in self.segments.items()}
