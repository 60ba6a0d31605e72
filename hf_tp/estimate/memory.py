"""Memory figures of one rank: the breakdown by category, and a lighter ``MemTracker``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

MiB = 2**20
GiB = 2**30


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


class PeakMemTracker(MemTracker):
    """``MemTracker`` that keeps the per-device peak, and per-module peaks only of watched modules.

    The per-module bookkeeping walks every tracked module on every op, about half the run time
    of an estimate; only the modules given to :meth:`watch` (the MoE experts) get their
    ``PEAK_FW``/``PEAK_BW`` snapshots. Every module still gets torch's ``PRE_FW``/``POST_FW``
    snapshots (taken in its hooks). Falls back to torch's version if its private fields change.
    """

    def __init__(self) -> None:
        super().__init__()
        self._watched: tuple[nn.Module, ...] = ()

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # torch's tracker hooks every parameter's gradient, and a frozen one (a LoRA run's base)
        # refuses a hook: mark those hooked already (they never get a gradient). Looked up at each
        # call: FSDP2 swaps in unsharded parameters around a forward.
        handles = getattr(self, "_param_to_grad_hook_handles", None)
        if install_grad_hooks and handles is not None:
            for p in module.parameters():
                if not p.requires_grad and handles.get(p, None) is None:
                    handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def watch(self, modules: Iterable[nn.Module]) -> None:
        """Keep the forward and backward peaks of ``modules`` too."""
        self._watched = tuple(modules)

    def _update_peak_stats(self, peak_state) -> None:
        current, peak, peak_snap = (getattr(self, n, None) for n in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"))
        if not (isinstance(current, dict) and isinstance(peak, dict) and isinstance(peak_snap, dict)):
            return super()._update_peak_stats(peak_state)
        for device, snap in current.items():
            total = snap.get("Total", 0)
            if peak.get(device, 0) < total:
                peak[device] = total
                peak_snap[device] = dict(snap)
        for module in self._watched:  # as torch does for every module, for these only
            stats = self.memory_tracking.get(module)
            if stats is None or stats.mod_fqn not in self._mod_tracker.parents or peak_state not in stats.snapshots:
                continue
            for device, snap in current.items():
                if stats.local_peak.get(device, 0) < snap.get("Total", 0):
                    stats.local_peak[device] = snap["Total"]
                    stats.snapshots[peak_state][-1][device] = dict(snap)


class _NoHook:
    """Stands for a hook handle that was never registered (removing it does nothing)."""

    def remove(self) -> None:
        pass
