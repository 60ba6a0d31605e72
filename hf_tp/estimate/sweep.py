"""Choosing (tp, dp) for a number of GPUs: estimate every valid split, keep the ones that fit.

With a named GPU (``cluster``), the splits that fit are ranked by predicted tokens/s per GPU
(:mod:`hf_tp.estimate.sweep_speed`: activation checkpointing where a split needs it, the per-rank
batch grown into the memory left). Without one, the rule: among the splits whose peak fits, the
smallest tp. Tensor parallelism puts collectives of the activations (all-gather + reduce-scatter,
twice per layer, forward and backward) on the critical path of every layer, and their volume grows
with the tokens; FSDP's parameter all-gathers and gradient reduce-scatters overlap with compute and
do not depend on the tokens. So tp is worth its cost only when memory requires it. ``cp`` and
``ep`` are fixed for a sweep: the splits are of world_size / cp ranks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.estimate.api import Estimate, GiB, estimate, validate_inputs
from hf_tp.estimate.layouts import FRAGMENTATION, RANK_RULE, RESERVED_BYTES, RULE, Sweep, fits
from hf_tp.estimate.speed import Cluster
from hf_tp.estimate.sweep_speed import speed_sweep

__all__ = [
    "FRAGMENTATION",
    "RANK_RULE",
    "RESERVED_BYTES",
    "RULE",
    "Sweep",
    "candidate_splits",
    "fits",
    "parse_memory",
    "recommend",
    "sweep",
]

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
    cp: int = 1,
    lora_r: int = 0,
    lora_target_modules: str = "all-linear",
) -> Sweep:
    """Estimate every valid (tp, dp) of ``world_size / cp`` ranks and recommend one.

    With ``cluster`` (its GPU's memory unless ``gpu_memory`` is given) the fastest layout that fits
    is recommended: a split that does not fit without activation checkpointing is also tried with
    it, and the per-rank batch (``batch_size`` at least) is doubled where memory allows; otherwise
    the smallest tp that fits, at ``batch_size``. ``ep`` and ``cp`` stay fixed: splits whose dp ep
    does not divide, or whose 2 x cp x tp does not divide ``seq_len``, are left out. ``lora_r`` > 0
    sweeps a LoRA run. ``progress`` gets one line before each simulation."""
    validate_inputs(config, 1, ep, seq_len, batch_size, dtype, ep, cp)  # sizes, positions, ep and cp, once
    if cluster is not None:
        cluster.gpu.peak_flops(dtype)  # a GPU without a published peak for dtype fails before simulating
        gpu_memory = gpu_memory or cluster.gpu.memory_bytes
    result = Sweep(world_size=world_size, gpu_memory=gpu_memory, ep=ep, cluster=cluster, cp=cp)
    splits = cp_splits(config, world_size, seq_len, ep, cp, result.skipped)
    run = functools.partial(
        estimate,
        config,
        seq_len=seq_len,
        batch_size=batch_size,
        dtype=dtype,
        model_name=model_name,
        ep=ep,
        cp=cp,
        lora_r=lora_r,
        lora_target_modules=lora_target_modules,
    )
    if cluster is not None:
        speed_sweep(result, splits, run, activation_checkpointing, progress)
        return result
    for i, (tp, dp) in enumerate(splits):
        if progress is not None:
            progress(f"simulating tp={tp}{f' x cp={cp}' if cp > 1 else ''} x dp={dp} (split {i + 1} of {len(splits)})")
        result.estimates.append(run(tp=tp, dp=dp, activation_checkpointing=activation_checkpointing))
    result.recommended = recommend(result.estimates, gpu_memory)
    return result


def cp_splits(
    config: PretrainedConfig, world_size: int, seq_len: int, ep: int, cp: int, skipped: list[str]
) -> list[tuple[int, int]]:
    """The (tp, dp) splits of ``world_size / cp`` ranks whose rows cp x tp can cut (a seq_len
    multiple of 2 x cp x tp) and whose dp x cp ranks ep divides; the others are noted in ``skipped``."""
    if not isinstance(world_size, int) or world_size < 1 or world_size % cp:
        raise ValueError(f"world_size must be a positive multiple of cp={cp}, got world_size={world_size!r}")
    if cp == 1:
        return candidate_splits(config, world_size, ep)
    splits = [(tp, dp) for tp, dp in candidate_splits(config, world_size // cp) if (dp * cp) % ep == 0]
    kept = [(tp, dp) for tp, dp in splits if seq_len % (2 * cp * tp) == 0]
    skipped += [
        f"tp={tp} x cp={cp} x dp={dp}: seq_len {seq_len} is not a multiple of 2*cp*tp ({2 * cp * tp})"
        for tp, dp in splits
        if (tp, dp) not in kept
    ]
    if not kept:
        raise ValueError(
            f"no split of {world_size} ranks at cp={cp} has 2*cp*tp dividing seq_len ({seq_len}) and ep={ep} "
            "dividing dp x cp"
        )
    return kept


def recommend(estimates: list[Estimate], gpu_memory: int | None) -> Estimate | None:
    """The estimate with the smallest tp among those that fit ``gpu_memory`` (None if none do)."""
    if gpu_memory is None:
        return None
    fitting = [e for e in estimates if fits(e, gpu_memory)]
    return min(fitting, key=lambda e: e.tp) if fitting else None
