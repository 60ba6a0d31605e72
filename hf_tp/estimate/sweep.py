"""Choosing (tp, dp) for a number of GPUs: estimate every valid split, keep the ones that fit.

With a named GPU (``cluster``), the splits that fit are ranked by predicted tokens/s per GPU
(:func:`speed_sweep`, below). Without one, the rule: among the splits whose peak fits, the
smallest tp. Tensor parallelism puts collectives of the activations (all-gather + reduce-scatter,
twice per layer, forward and backward) on the critical path of every layer, and their volume grows
with the tokens; FSDP's parameter all-gathers and gradient reduce-scatters overlap with compute and
do not depend on the tokens. So tp is worth its cost only when memory requires it. ``cp`` and
``ep`` are fixed for a sweep: the splits are of world_size / cp ranks.

The search on a named GPU (:func:`speed_sweep`): which layouts to simulate, ranked by predicted
tokens/s. Three dimensions besides the (tp, dp) split (``cp`` and ``ep`` stay as given):

- tp groups wider than a node are left out (TP's per-layer collectives would cross the network);
- activation checkpointing is simulated where a layout does not fit without it, unless its speed
  without recompute (an upper bound) already loses to a layout that fits;
- the per-rank batch is doubled, up to :data:`MAX_BATCH_FACTOR` x the given one, into the memory a
  fitting layout leaves. Larger batches only amortise more (FSDP's traffic hides behind more
  compute, per-call latencies spread over more tokens), so each layout gets its largest batch that
  fits, found in at most :data:`BATCH_TRIES` simulations: a first guess from the peak's activations
  and temporaries (the parts that grow with the batch), then a straight line through the two
  simulated peaks. A layout is not grown when even an unlimited batch could not beat the best one
  (its matmul and attention time per token alone is slower).

On a named GPU the sweep also tries HSDP and pipeline layouts (:mod:`hf_tp.estimate.search`),
each estimated from one simulated stage (:mod:`hf_tp.estimate.layouts`); layouts that simulate the
same stage share one simulation (a cache keyed by the simulated config and shape).

A sweep's result: the layouts it simulated, which of them fit a GPU's memory, and how the
fitting ones rank by predicted speed (shared by the sweep, its speed search and the reports).

Fast by default: each candidate layout is estimated from short runs of the model extended to its
depth (:func:`estimate_candidate`, :mod:`hf_tp.estimate.depth`; a pipeline layout's stage alike),
and only the recommended layout is then simulated at every layer (:func:`verify_best`): the
recommendation's memory is the full simulation's, and where that does not fit, the next layout is
checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.estimate.api import Estimate, estimate_spec
from hf_tp.estimate.depth import estimate_fast
from hf_tp.estimate.layouts import Simulate, SimulationCache, estimate_layout
from hf_tp.estimate.search import (
    BATCH_TRIES,
    FRAGMENTATION,
    MAX_BATCH_FACTOR,
    RANK_RULE,
    RESERVED_BYTES,
    RULE,
    SCHEDULES,
    Layout,
    Progress,
    Sweep,
    _say,
    compute_bound,
    describe_layout,
    fits,
    grow_batch,
    headroom,
    hsdp_layouts,
    next_batch,
    pipeline_layouts,
    simulate_splits,
    speed_sweep,
    usable_peak,
)
from hf_tp.estimate.spec import EstimateSpec, validate
from hf_tp.estimate.speed import Cluster
from hf_tp.layout import row_multiple


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
    spec: EstimateSpec | None = None,
    *,
    gpu_memory: int | None = None,
    model_name: str | None = None,
    progress: Callable[[str], None] | None = None,
    cluster: Cluster | None = None,
    grow: bool = True,
    simulate: Simulate | None = None,
    pp_schedules: tuple[str, ...] = SCHEDULES,
    fast: bool = True,
    verified: int = 1,
    **named,
) -> Sweep:
    """Estimate every valid (tp, dp) of ``world_size / cp`` ranks of ``spec`` (or of the
    :class:`EstimateSpec` of ``named``: ``seq_len``, ``batch_size``, ``dtype``, ``ep``, ``cp``, ...;
    its tp and dp are the sweep's to choose) and recommend one.

    With ``cluster`` (its GPU's memory unless ``gpu_memory`` is given) the fastest layout that fits
    is recommended: a split that does not fit without activation checkpointing is also tried with
    it, and the per-rank batch (``batch_size`` at least) is doubled where memory allows
    (:func:`speed_sweep`); otherwise the smallest tp that fits, at ``batch_size``. ``ep``
    and ``cp`` stay fixed: splits whose dp ep does not divide, or whose 2 x cp x tp does not divide
    ``seq_len``, are left out. ``grow=False`` keeps the batch as given (``hf-tp train --layout auto``).
    With ``cluster`` HSDP and pipeline layouts (of ``pp_schedules``; none: ``()``) join the (tp, dp)
    splits. ``simulate`` runs one stage's simulation (default: :func:`estimate_candidate`'s).
    ``progress`` gets one line before each simulation. ``fast`` estimates each layout from short
    runs, then simulates the best ``verified`` layouts in full (:func:`verify_best`); ``fast=False``
    simulates every layout at every layer."""
    spec = spec or EstimateSpec(tp=1, dp=1, **named)
    validate(config, spec.replace(tp=1, dp=spec.ep, dp_replicate=1))  # sizes, positions, ep and cp, once
    if cluster is not None:
        cluster.gpu.peak_flops(spec.dtype)  # a GPU without a published peak for dtype fails before simulating
        gpu_memory = gpu_memory or cluster.gpu.memory_bytes
    result = Sweep(world_size=world_size, gpu_memory=gpu_memory, ep=spec.ep, cluster=cluster, cp=spec.cp)
    splits = cp_splits(config, world_size, spec.seq_len, spec.ep, spec.cp, result.skipped)
    cache = SimulationCache(simulate or (estimate_fast if fast else estimate_spec))

    def run(**changes) -> Estimate:
        return estimate_layout(config, spec.replace(**changes), model_name, cache)

    if cluster is not None:
        node = cluster.gpu.gpus_per_node
        plain = [Layout(tp, dp) for tp, dp in splits]
        layouts = plain + hsdp_layouts(plain, node) if spec.cp == 1 and spec.ep == 1 else plain
        stages = pipeline_layouts(
            config, world_size, spec, node, grow, lambda n: candidate_splits(config, n), result.skipped, pp_schedules
        )
        layouts += stages + (hsdp_layouts(stages, node) if spec.cp == 1 and spec.ep == 1 else [])
        speed_sweep(result, layouts, run, spec.activation_checkpointing, progress, grow)
    else:
        cp = f" x cp={spec.cp}" if spec.cp > 1 else ""
        for i, (tp, dp) in enumerate(splits):
            _say(progress, f"simulating tp={tp}{cp} x dp={dp} (split {i + 1} of {len(splits)})")
            result.estimates.append(run(tp=tp, dp=dp))
        result.recommended = recommend(result.estimates, gpu_memory)
    verify_best(result, config, model_name, progress, verified)
    return result


def estimate_candidate(
    config: PretrainedConfig, spec: EstimateSpec, model_name: str | None = None, fast: bool = True
) -> Estimate:
    """One layout's estimate as a sweep makes it (pp and HSDP by arithmetic on one simulated stage,
    :func:`hf_tp.estimate.layouts.estimate_layout`): the stage from the model cut to a few periods of
    its layers and extended to its depth (``fast``, :func:`hf_tp.estimate.depth.estimate_fast`), or
    every layer simulated."""
    return estimate_layout(config, spec, model_name, estimate_fast if fast else estimate_spec)


def ordered(result: Sweep) -> list[Estimate]:
    """The layouts that fit, best first: by predicted speed with a cluster, else by the smallest tp."""
    if result.cluster is not None:
        return [e for e, _ in result.ranking()]
    if result.gpu_memory is None:
        return []
    return sorted((e for e in result.estimates if fits(e, result.gpu_memory)), key=lambda e: e.tp)


def verify_best(
    result: Sweep, config: PretrainedConfig, model_name: str | None, progress: Progress, count: int = 1
) -> None:
    """Simulate at every layer the best ``count`` layouts that were estimated from short runs,
    replacing their estimates, until the best ``count`` are all full simulations (a layout that no
    longer fits drops out, and the next is checked); then recommend the best."""
    while todo := [e for e in ordered(result)[:count] if e.extended_from]:
        for est in todo:
            ac = ", activation checkpointing" if est.activation_checkpointing else ""
            _say(progress, f"simulating {describe_layout(est)}{ac}, batch {est.batch_size}, at every layer (the best)")
            at = next(i for i, e in enumerate(result.estimates) if e is est)
            result.estimates[at] = estimate_candidate(config, est.spec, model_name, fast=False)
    best = ordered(result)
    result.recommended = best[0] if best else None


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
    kept = [(tp, dp) for tp, dp in splits if seq_len % row_multiple(tp, cp) == 0]
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


__all__ = [
    "BATCH_TRIES", "FRAGMENTATION", "MAX_BATCH_FACTOR", "RANK_RULE", "RESERVED_BYTES", "RULE", "Sweep",
    "candidate_splits", "compute_bound", "cp_splits", "estimate_candidate", "fits", "grow_batch", "headroom", "next_batch",
    "ordered", "recommend", "simulate_splits", "speed_sweep", "sweep", "usable_peak", "verify_best",
]  # fmt: skip
