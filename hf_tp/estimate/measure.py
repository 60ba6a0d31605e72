"""Measuring the real memory of a training step (CPU or GPU), to check :func:`hf_tp.estimate.api`.

Runs the same program as the estimate (``hf_tp.estimate.step``) on real tensors in an initialised
process group (gloo), with torch's ``MemTracker`` in eager mode and, for reference, the process's
peak resident set size (Linux ``/proc``), which also counts allocator and library overhead.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from hf_tp.estimate.memory import MemoryBreakdown, PeakMemTracker
from hf_tp.estimate.step import (
    build_optimizer,
    init_optimizer_state,
    make_batch,
    model_from_config,
    text_vocab_size,
    train_step,
)


@dataclass(frozen=True)
class Measurement:
    """One rank's tracked memory for a real step, plus resident-memory figures (None off Linux)."""

    peak: MemoryBreakdown
    state: MemoryBreakdown
    rss_peak_delta: int | None  # peak RSS during the tracked steps, minus RSS before the model was built
    seconds: float
    cuda_peak: int | None = None  # torch.cuda.max_memory_allocated over the tracked steps (GPU runs)


def _status_kib(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", status.read_text(), re.MULTILINE)
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(
    config: PretrainedConfig,
    mesh: DeviceMesh,
    seq_len: int,
    batch_size: int,
    dtype: str = "fp32",
    activation_checkpointing: bool = False,
    steps: int = 1,
    seed: int = 0,
    ep: int = 1,
    lora_r: int = 0,
    lora_target_modules: str = "all-linear",
) -> Measurement:
    """Build the model on real tensors on the mesh's device (CPU, or this rank's GPU), run ``steps``
    tracked training steps, report this rank.

    ``mesh`` is the ("dp", "tp") mesh of an initialised process group (``ep`` of its dp ranks
    splitting the experts; ``lora_r`` > 0: a LoRA run as the estimate sizes it). The optimizer state is
    created before tracking starts, as in the estimate. On a GPU the caching allocator's own peak
    (``torch.cuda.max_memory_allocated``, reset after the optimizer state exists) is reported too.
    """
    start = time.perf_counter()
    torch.manual_seed(seed)
    cuda = mesh.device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rss_before = _status_kib("VmRSS")
    with device:  # factory functions (the model's weights, the batch) allocate on the mesh's device
        model = model_from_config(config, mesh, dtype, activation_checkpointing, ep, lora_r, lora_target_modules)
        optimizer = build_optimizer(model)
        init_optimizer_state(model, optimizer)
        batch = make_batch(text_vocab_size(config), batch_size, seq_len)
    can_reset = _reset_peak_rss()  # the steps' peak, not the model build's temporary copies
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = PeakMemTracker()
    tracker.track_external(model, optimizer)
    after: list[dict] = []
    with tracker:
        for _ in range(steps):
            tracker.reset_mod_stats()  # MemTracker refuses a second forward of the same modules otherwise
            after_step = lambda: after.append(tracker.get_tracker_snapshot("current"))  # noqa: E731
            train_step(model, optimizer, batch, mesh["dp"].size(), after_optimizer_step=after_step)
    rss_peak = _status_kib("VmHWM")
    cuda_peak = torch.cuda.max_memory_allocated() if cuda else None
    rss_delta = None
    if can_reset and rss_before is not None and rss_peak is not None:
        rss_delta = (rss_peak - rss_before) * 1024
    return Measurement(
        peak=MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak")),
        state=MemoryBreakdown.from_snapshot(after[-1]),
        rss_peak_delta=rss_delta,
        seconds=time.perf_counter() - start,
        cuda_peak=cuda_peak,
    )
