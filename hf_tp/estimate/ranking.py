"""What a sweep finds: the layouts it simulated, which fit a GPU's memory (:func:`fits`, with the
margins of :data:`RULE`) and how the fitting ones rank by predicted speed (:class:`Sweep`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_tp.estimate.api import Estimate
from hf_tp.estimate.candidates import layout_of
from hf_tp.estimate.spec import GiB
from hf_tp.estimate.speed import Cluster, Speed, predict

# What a real GPU needs beyond the tensors the estimate counts: the CUDA context, NCCL buffers
# and workspaces (RESERVED), and the caching allocator's rounding and fragmentation (a margin).
RESERVED_BYTES = 1 * GiB
FRAGMENTATION = 0.10

RULE = (
    "rule: the smallest tp that fits. TP's activation collectives sit on every layer's critical path "
    "and grow with tokens; FSDP's parameter collectives overlap with compute. A split fits when "
    f"peak x {1 + FRAGMENTATION:.2f} (allocator fragmentation) + {RESERVED_BYTES / GiB:.0f} GiB "
    "(CUDA context, NCCL buffers) <= GPU memory."
)

RANK_RULE = (
    "rank: predicted tokens/s per GPU among the layouts that fit (peak x 1.10 + 1 GiB <= GPU memory); "
    "activation checkpointing only where a layout does not fit without it; the per-rank batch doubled "
    "(up to 8x --batch-size) where the memory left allows; across nodes also HSDP and pipeline layouts "
    "(pp 2-16, 1F1B and Interleaved 1F1B, 8 x pp micro-batches of --batch-size rows)."
)


def usable_peak(peak_bytes: float, gpu_memory: int) -> float:
    """GPU memory left over a peak of ``peak_bytes`` after the margins of :data:`RULE` (negative: does not fit)."""
    return gpu_memory - peak_bytes * (1 + FRAGMENTATION) - RESERVED_BYTES


def fits(est: Estimate, gpu_memory: int) -> bool:
    """Whether ``est``'s peak, with the margins of :data:`RULE`, fits in ``gpu_memory`` bytes."""
    return usable_peak(est.peak.total, gpu_memory) >= 0


def headroom(est: Estimate, gpu_memory: int) -> float:
    """GiB of GPU memory left after ``est``'s peak and the margins."""
    return usable_peak(est.peak.total, gpu_memory) / GiB


@dataclass
class Sweep:
    """The estimates of every split of ``world_size`` GPUs and the recommended one (or None).

    ``cp`` and ``ep`` are fixed for the whole sweep; with a ``cluster`` the per-rank batch varies
    (each estimate carries its own ``batch_size``)."""

    world_size: int
    gpu_memory: int | None
    ep: int = 1
    estimates: list[Estimate] = field(default_factory=list)
    recommended: Estimate | None = None
    cluster: Cluster | None = None
    skipped: list[str] = field(default_factory=list)  # layouts not simulated, and why
    cp: int = 1

    def ranking(self) -> list[tuple[Estimate, Speed]]:
        """The estimates that fit with their predicted speed, fastest first (empty without a cluster)."""
        if self.cluster is None or self.gpu_memory is None:
            return []
        fitting = [(e, predict(e, self.cluster)) for e in self.estimates if fits(e, self.gpu_memory)]
        return sorted(fitting, key=lambda pair: -pair[1].tokens_per_second_per_gpu)

    def best_speed(self) -> float:
        """Predicted tokens/s per GPU of the fastest layout that fits so far (0 if none)."""
        ranked = self.ranking()
        return ranked[0][1].tokens_per_second_per_gpu if ranked else 0.0

    def to_dict(self) -> dict:
        speeds = {id(e): s for e, s in self.ranking()}
        r = self.recommended
        return {
            "world_size": self.world_size,
            "gpu_memory": self.gpu_memory,
            "ep": self.ep,
            "cp": self.cp,
            "rule": RANK_RULE if self.cluster else RULE,
            "gpu": None if self.cluster is None else self.cluster.gpu.to_dict(),
            "inter_node_gbps": None if self.cluster is None else self.cluster.inter_node_gbps,
            "estimates": [
                {
                    **e.to_dict(),
                    "fits": None if self.gpu_memory is None else fits(e, self.gpu_memory),
                    "speed": speeds[id(e)].to_dict() if id(e) in speeds else None,
                }
                for e in self.estimates
            ],
            "skipped": self.skipped,
            "recommended": None
            if r is None
            else {**layout_of(r).changes(), "cp": r.cp, "activation_checkpointing": r.activation_checkpointing},
        }
