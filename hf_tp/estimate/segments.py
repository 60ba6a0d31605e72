"""The step's memory cut into segments at the decoder layers' boundaries: the most each segment held.

A segment runs from one decoder-layer event to the next: a layer's forward starting or ending, its
backward starting or ending, in the forward or inside backward (activation checkpointing's
recompute), plus the optimizer step and what comes before the first layer. The tracker keeps, per
(event, in backward, layer index), the largest total any op of the segment left live and the
breakdown at that moment (:class:`SegmentTracker`). :mod:`hf_tp.estimate.depth` reads them from
two short runs of the model to place the full depth's peak (see that module).
"""

from __future__ import annotations

from torch import nn

from hf_tp.estimate.memory import MemoryBreakdown, PeakMemTracker

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

    def _mark(self, module: nn.Module | None, event: str) -> None:
        index = self._layer_index.get(id(module)) if module is not None else None
        if index is not None:
            self._segment = (event, bool(self._mod_tracker.is_bw), index)

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        super()._pre_fw_hook(module, inputs)
        self._mark(module, "fwd_pre")

    def _post_fw_hook(self, module: nn.Module, inputs, outputs) -> None:
        super()._post_fw_hook(module, inputs, outputs)
        self._mark(module, "fwd_post")

    def _pre_bw_hook(self, module: nn.Module, args) -> None:
        super()._pre_bw_hook(module, args)
        self._mark(module, "bwd_pre")

    def _post_bw_hook(self, module: nn.Module, args) -> None:
        super()._post_bw_hook(module, args)
        self._mark(module, "bwd_post")

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        current = getattr(self, "_curr_mem_snap", None)
        if not isinstance(current, dict):
            return
        total = sum(int(snap.get("Total", 0)) for snap in current.values())
        key = OPTIMIZER if getattr(self, "_in_opt", False) else self._segment
        held = self.segments.get(key)
        if held is None or held[0] < total:
            self.segments[key] = (total, {device: dict(snap) for device, snap in current.items()})

    def breakdowns(self) -> dict[SegmentKey, MemoryBreakdown]:
        """Each segment's largest moment, by category."""
        return {key: MemoryBreakdown.from_snapshot(snap) for key, (_, snap) in self.segments.items()}
