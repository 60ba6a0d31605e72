"""torch's ``MemTracker`` (``torch.distributed._tools``), made lighter and given public hooks.

:func:`peak_mem_tracker_class` builds ``PeakMemTracker`` on first use (also as
``from hf_tp.compat.mem_tracker import PeakMemTracker``): the tracker
:mod:`hf_tp.estimate.memory` measures a step with. Everything it overrides of torch's private
hooks and fields is here; a subclass overrides :meth:`on_module` (a module's forward or backward
starts or ends) and :meth:`on_snapshot` (the memory held changed) instead.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

from hf_tp.compat.reaches import reaches

TRACKER = "torch.distributed._tools.mem_tracker:MemTracker"
EVENTS = ("fwd_pre", "fwd_post", "bwd_pre", "bwd_post")  # what on_module is told
# torch's ModTracker (inside MemTracker), when a module's forward starts while one of its name runs.
MESSED_UP = r"The module hierarchy tracking maybe be messed up\. Please file a bug to PyTorch, if it is the case\.$"


@contextlib.contextmanager
def quiet_module_tracking() -> Iterator[None]:
    """Exactly torch's ModTracker warning :data:`MESSED_UP` silenced: it warns when a module's
    forward starts while a module of the same name runs (a module called inside itself, a
    family's shared submodule), which leaves that module's own per-module figures in doubt, never
    the per-device peak an estimate reads. torch also replaces ``warnings.formatwarning`` for the
    whole process as it warns: restored on the way out."""
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=MESSED_UP, category=UserWarning)
        try:
            yield
        finally:
            warnings.formatwarning = formatwarning


class _NoHook:
    """Stands for a hook handle that was never registered (removing it does nothing)."""

    def remove(self) -> None:
        pass


def _mark_frozen_hooked(tracker: Any, module: Any, install_grad_hooks: bool) -> None:
    """torch's tracker hooks every parameter's gradient, and a frozen one (a LoRA run's base)
    refuses a hook: mark those hooked already (they never get a gradient). Looked up at each call:
    FSDP2 swaps in unsharded parameters around a forward."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if install_grad_hooks and handles is not None:
        for p in module.parameters():
            if not p.requires_grad and handles.get(p, None) is None:
                handles[p] = (_NoHook(), _NoHook())


def _keep_peaks(tracker: Any, peak_state: Any) -> bool:
    """The per-device peak, and the per-module peaks of the watched modules only (as torch does
    for every module); False (nothing done) if torch's private fields changed."""
    current, peak, peak_snap = (getattr(tracker, n, None) for n in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"))
    if not (isinstance(current, dict) and isinstance(peak, dict) and isinstance(peak_snap, dict)):
        return False
    for device, snap in current.items():
        total = snap.get("Total", 0)
        if peak.get(device, 0) < total:
            peak[device] = total
            peak_snap[device] = dict(snap)
    for module in tracker._watched:
        stats = tracker.memory_tracking.get(module)
        if stats is None or stats.mod_fqn not in tracker._mod_tracker.parents or peak_state not in stats.snapshots:
            continue
        for device, snap in current.items():
            if stats.local_peak.get(device, 0) < snap.get("Total", 0):
                stats.local_peak[device] = snap["Total"]
                stats.snapshots[peak_state][-1][device] = dict(snap)
    return True


def _snapshot_taken(tracker: Any) -> None:
    """Tell :meth:`on_snapshot` the memory held now, and whether the optimizer's step runs."""
    current = getattr(tracker, "_curr_mem_snap", None)
    if isinstance(current, dict):
        tracker.on_snapshot(current, bool(getattr(tracker, "_in_opt", False)))


@reaches(
    TRACKER,
    *(f"{TRACKER}.{hook}" for hook in ("_track_module_params_and_buffers", "_update_peak_stats")),
    *(f"{TRACKER}._{kind}_hook" for kind in ("pre_fw", "post_fw", "pre_bw", "post_bw")),
    *(f"{TRACKER}().{f}" for f in ("_param_to_grad_hook_handles", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")),
    f"{TRACKER}()._in_opt",
    f"{TRACKER}()._mod_tracker.parents",
    f"{TRACKER}()._mod_tracker.is_bw",
)
@functools.cache
def peak_mem_tracker_class() -> type:
    """``PeakMemTracker``: a ``MemTracker`` that keeps the per-device peak, and per-module peaks only
    of the modules given to ``watch`` (torch's per-module bookkeeping walks every tracked module on
    every op, about half the run time of an estimate). Every module still gets torch's
    ``PRE_FW``/``POST_FW`` snapshots. Falls back to torch's version if its private fields change."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakMemTracker(MemTracker):
        __doc__ = peak_mem_tracker_class.__doc__

        def __init__(self) -> None:
            super().__init__()
            self._watched: tuple = ()

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True) -> tuple[int, int]:
            _mark_frozen_hooked(self, module, install_grad_hooks)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def __enter__(self):
            self._quiet = quiet_module_tracking()
            self._quiet.__enter__()
            return super().__enter__()

        def __exit__(self, *exc) -> None:
            try:
                super().__exit__(*exc)
            finally:
                self._quiet.__exit__(None, None, None)

        def watch(self, modules) -> None:
            """Keep the forward and backward peaks of ``modules`` too."""
            self._watched = tuple(modules)

        def on_module(self, module, event: str, backward: bool) -> None:
            """``module``'s ``event`` (one of :data:`EVENTS`), ``backward``: inside autograd's backward."""

        def on_snapshot(self, current: dict, optimizer: bool) -> None:
            """The memory held now (``{device: {category: bytes}}``); ``optimizer``: inside its step."""

        def _update_peak_stats(self, peak_state) -> None:
            if not _keep_peaks(self, peak_state):
                super()._update_peak_stats(peak_state)
            _snapshot_taken(self)

        def _pre_fw_hook(self, module, inputs) -> None:
            super()._pre_fw_hook(module, inputs)
            self.on_module(module, "fwd_pre", bool(self._mod_tracker.is_bw))

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            super()._post_fw_hook(module, inputs, outputs)
            self.on_module(module, "fwd_post", bool(self._mod_tracker.is_bw))

        def _pre_bw_hook(self, module, args) -> None:
            super()._pre_bw_hook(module, args)
            self.on_module(module, "bwd_pre", bool(self._mod_tracker.is_bw))

        def _post_bw_hook(self, module, args) -> None:
            super()._post_bw_hook(module, args)
            self.on_module(module, "bwd_post", bool(self._mod_tracker.is_bw))

    return PeakMemTracker


def __getattr__(name: str) -> Any:
    """``PeakMemTracker``, built when first asked for (:func:`peak_mem_tracker_class`)."""
    if name == "PeakMemTracker":
        return peak_mem_tracker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@reaches(f"{TRACKER}().memory_tracking", "torch.distributed._tools.mem_tracker:_ModState.PRE_FW")
@reaches(*(f"torch.distributed._tools.mem_tracker:_ModState.{s}" for s in ("POST_FW", "PEAK_FW")))
def forward_snapshots(tracker: Any, module: Any) -> tuple[dict, dict, dict]:
    """The memory a tracked ``module``'s first forward began with, ended with and peaked at
    (``{device: {category: bytes}}`` each)."""
    from torch.distributed._tools.mem_tracker import _ModState

    snaps = tracker.memory_tracking[module].snapshots
    return tuple(snaps[state][0] for state in (_ModState.PRE_FW, _ModState.POST_FW, _ModState.PEAK_FW))
