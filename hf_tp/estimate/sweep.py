"""Choosing (tp, dp) for a number of GPUs: estimate every valid split, keep the ones that fit.

With a named GPU (``cluster``), the splits that fit are ranked by predicted tokens/s per GPU
(:mod:`hf_tp.estimate.speed`); a split that does not fit without activation checkpointing is
tried again with it. Without one, the rule: among the splits whose peak fits, the smallest tp. Tensor parallelism puts
collectives of the activations (all-gather + reduce-scatter, twice per layer, forward and backward)
on the critical path of every layer, and their volume grows with the tokens; FSDP's parameter
all-gathers and gradient reduce-scatters overlap with compute and do not depend on the tokens.
So tp is worth its cost only when memory requires it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.estimate.api import Estimate, GiB, estimate, validate_inputs
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
    "activation checkpointing only where a layout does not fit without it."
)

_UNITS = {
    "": GiB,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_memory(text: str) -> int:
    """Bytes in ``"80GiB"``, ``"141GB"`` (decimal), ``"80G"``/``"80Gi"`` (binary) or ``"80"`` (GiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--gpu-memory '{text}' is not a memory size; write it like 80GiB, 141GB or 80")
    return int(float(match.group(1)) * _UNITS[unit])


def fits(est: Estimate, gpu_memory: int) -> bool:
    """Whether ``est``'s peak, with the margins of :data:`RULE`, fits in ``gpu_memory`` bytes."""
    return est.peak.total * (1 + FRAGMENTATION) + RESERVED_BYTES <= gpu_memory


def candidate_splits(config: PretrainedConfig, world_size: int, ep: int = 1) -> list[tuple[int, int]]:
    """Every (tp, dp) with tp * dp = world_size, tp valid for this model and dp a multiple of
    ``ep``, smallest tp first."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got world_size={world_size!r}")
    valid = [tp for tp in get_adapter(config).valid_tp_sizes(config) if world_size % tp == 0]
    splits = [(tp, world_size // tp) for tp in valid if (world_size // tp) % ep == 0]
    if not splits:
        raise ValueError(
            f"no (tp, dp) split of {world_size} ranks has a dp divisible by ep={ep} "
            f"(valid tp for this model: {', '.join(map(str, valid))})"
        )
    return splits


@dataclass
class Sweep:
    """The estimates of every split of ``world_size`` GPUs and the recommended one (or None)."""

    world_size: int
    gpu_memory: int | None
    ep: int = 1
    estimates: list[Estimate] = field(default_factory=list)
    recommended: Estimate | None = None
    cluster: Cluster | None = None
    skipped: list[str] = field(default_factory=list)  # layouts not simulated, and why

    def ranking(self) -> list[tuple[Estimate, Speed]]:
        """The estimates that fit with their predicted speed, fastest first (empty without a cluster)."""
        if self.cluster is None or self.gpu_memory is None:
            return []
        fitting = [(e, predict(e, self.cluster)) for e in self.estimates if fits(e, self.gpu_memory)]
        return sorted(fitting, key=lambda pair: -pair[1].tokens_per_second_per_gpu)

    def to_dict(self) -> dict:
        speeds = {id(e): s for e, s in self.ranking()}
        r = self.recommended
        return {
            "world_size": self.world_size,
            "gpu_memory": self.gpu_memory,
            "ep": self.ep,
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
            else {"tp": r.tp, "dp": r.dp, "activation_checkpointing": r.activation_checkpointing},
        }


def sweep(
    config: PretrainedConfig,
    world_size: int,
    seq_len: int,
    batch_size: int,
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
    gpu_memory: int | None = None,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    ep: int = 1,
    cluster: Cluster | None = None,
) -> Sweep:
    """Estimate every valid (tp, dp) of ``world_size`` ranks and recommend one.

    With ``cluster`` (its GPU's memory unless ``gpu_memory`` is given) the fastest split that fits
    is recommended, and a split that does not fit without activation checkpointing is also tried
    with it; otherwise the smallest tp that fits. ``ep`` stays fixed: splits whose dp it does not
    divide are left out. ``progress`` gets one line before each simulation."""
    validate_inputs(config, 1, ep, seq_len, batch_size, dtype, ep)  # sizes, positions and ep, once
    if cluster is not None:
        cluster.gpu.peak_flops(dtype)  # a GPU without a published peak for dtype fails before simulating
        gpu_memory = gpu_memory or cluster.gpu.memory_bytes
    splits = candidate_splits(config, world_size, ep)
    result = Sweep(world_size=world_size, gpu_memory=gpu_memory, ep=ep, cluster=cluster)
    run = functools.partial(
        estimate, config, seq_len=seq_len, batch_size=batch_size, dtype=dtype, model_name=model_name, ep=ep
    )
    if cluster is not None:
        _speed_sweep(result, splits, run, activation_checkpointing, progress)
        return result
    for i, (tp, dp) in enumerate(splits):
        if progress is not None:
            progress(f"simulating tp={tp} x dp={dp} (split {i + 1} of {len(splits)})")
        result.estimates.append(run(tp=tp, dp=dp, activation_checkpointing=activation_checkpointing))
    result.recommended = recommend(result.estimates, gpu_memory)
    return result


def _speed_sweep(
    result: Sweep, splits: list[tuple[int, int]], run: Callable[..., Estimate], ac: bool, progress
) -> None:
    """The sweep with a cluster: largest tp first; tp groups wider than a node are left out (TP's
    per-layer collectives would cross the network); a split that does not fit is simulated again
    with activation checkpointing unless its speed without recompute (an upper bound) already
    loses to a layout that fits."""
    cluster, memory = result.cluster, result.gpu_memory
    node = cluster.gpu.gpus_per_node
    kept = [s for s in splits if s[0] <= node] or splits
    result.skipped += [
        f"tp={tp} x dp={dp}: a tp group wider than a node ({node} GPUs)" for tp, dp in splits if (tp, dp) not in kept
    ]
    for i, (tp, dp) in enumerate(reversed(kept)):
        where = f"(split {i + 1} of {len(kept)})"
        if progress is not None:
            progress(f"simulating tp={tp} x dp={dp}{', activation checkpointing' if ac else ''} {where}")
        est = run(tp=tp, dp=dp, activation_checkpointing=ac)
        result.estimates.append(est)
        if ac or fits(est, memory):
            continue
        best = result.ranking()[:1]
        bound = predict(est, cluster).tokens_per_second_per_gpu
        if best and bound <= best[0][1].tokens_per_second_per_gpu:
            result.skipped.append(
                f"tp={tp} x dp={dp} with activation checkpointing: at most {bound:,.0f} tokens/s per GPU "
                f"(its speed without recompute), below the best that fits"
            )
            continue
        if progress is not None:
            progress(f"simulating tp={tp} x dp={dp}, activation checkpointing {where}")
        result.estimates.append(run(tp=tp, dp=dp, activation_checkpointing=True))
    ranked = result.ranking()
    result.recommended = ranked[0][0] if ranked else None


def recommend(estimates: list[Estimate], gpu_memory: int | None) -> Estimate | None:
    """The estimate with the smallest tp among those that fit ``gpu_memory`` (None if none do)."""
    if gpu_memory is None:
        return None
    fitting = [e for e in estimates if fits(e, gpu_memory)]
    return min(fitting, key=lambda e: e.tp) if fitting else None
