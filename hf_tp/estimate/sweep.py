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

A sweep's result: the layouts it simulated, which of them fit a GPU's memory, and how the
fitting ones rank by predicted speed (shared by the sweep, its speed search and the reports).

Fast by default: each candidate layout is estimated from short runs of the model extended to its
depth (:func:`estimate_candidate`, :mod:`hf_tp.estimate.depth`), and only the recommended layout is
then simulated at every layer (:func:`verify_best`): the recommendation's memory is the full
simulation's, and where that does not fit, the next layout is checked the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.estimate.api import Estimate, estimate_spec
from hf_tp.estimate.depth import estimate_fast
from hf_tp.estimate.spec import EstimateSpec, GiB, validate
from hf_tp.estimate.speed import Cluster, Speed, predict, tokens_per_gpu
from hf_tp.layout import row_multiple

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
    "(up to 8x --batch-size) where the memory left allows."
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
            else {
                "tp": r.tp,
                "cp": r.cp,
                "dp": r.dp,
                "batch_size": r.batch_size,
                "activation_checkpointing": r.activation_checkpointing,
            },
        }


MAX_BATCH_FACTOR = 8
BATCH_TRIES = 2

Progress = Callable[[str], None] | None


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
    ``progress`` gets one line before each simulation. ``fast`` estimates each layout from short
    runs (:func:`estimate_candidate`), then simulates the best ``verified`` layouts in full
    (:func:`verify_best`); ``fast=False`` simulates every layout at every layer."""
    spec = spec or EstimateSpec(tp=1, dp=1, **named)
    validate(config, spec.replace(tp=1, dp=spec.ep, dp_replicate=1))  # sizes, positions, ep and cp, once
    if cluster is not None:
        cluster.gpu.peak_flops(spec.dtype)  # a GPU without a published peak for dtype fails before simulating
        gpu_memory = gpu_memory or cluster.gpu.memory_bytes
    result = Sweep(world_size=world_size, gpu_memory=gpu_memory, ep=spec.ep, cluster=cluster, cp=spec.cp)
    splits = cp_splits(config, world_size, spec.seq_len, spec.ep, spec.cp, result.skipped)

    def run(**changes) -> Estimate:
        return estimate_candidate(config, spec.replace(**changes), model_name, fast)

    if cluster is not None:
        speed_sweep(result, splits, run, spec.activation_checkpointing, progress, grow)
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
    """One candidate layout's estimate, the one call a sweep makes per layout it tries: from the model
    cut to a few periods of its layers and extended to its depth (``fast``,
    :func:`hf_tp.estimate.depth.estimate_fast`), or every layer simulated."""
    return estimate_fast(config, spec, model_name) if fast else estimate_spec(config, spec, model_name)


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
            _say(progress, f"simulating {layout_name(est)}{ac}, batch {est.batch_size}, at every layer (the best)")
            at = next(i for i, e in enumerate(result.estimates) if e is est)
            result.estimates[at] = estimate_spec(config, est.spec, model_name)
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


def layout_name(est: Estimate) -> str:
    """``tp=2 x dp=4`` (``tp=2 x cp=2 x dp=4`` with context parallelism)."""
    return f"tp={est.tp}{f' x cp={est.cp}' if est.cp > 1 else ''} x dp={est.dp}"


def speed_sweep(
    result: Sweep,
    splits: list[tuple[int, int]],
    run: Callable[..., Estimate],
    ac: bool,
    progress: Progress,
    grow: bool = True,
) -> None:
    """Simulate ``splits`` (largest tp first), grow the batch of those that fit (unless ``grow`` is
    False), recommend the fastest."""
    simulate_splits(result, splits, run, ac, progress)
    for est, speed in list(result.ranking()) if grow else []:  # fastest first: the bound below prunes the most
        bound = compute_bound(est, speed)
        if bound <= result.best_speed():  # (the best layout's bound is above its own speed)
            result.skipped.append(
                f"{layout_name(est)} at a batch above {est.batch_size}: at most {bound:,.0f} tokens/s per GPU "
                "(its matmul and attention time alone), below the best that fits"
            )
            continue
        grow_batch(result, est, run, progress)
    ranked = result.ranking()
    result.recommended = ranked[0][0] if ranked else None


def simulate_splits(
    result: Sweep, splits: list[tuple[int, int]], run: Callable[..., Estimate], ac: bool, progress: Progress
) -> None:
    """Each split at the given batch, again with activation checkpointing where it does not fit
    (unless its speed without recompute already loses); tp wider than a node left out."""
    cluster, memory = result.cluster, result.gpu_memory
    node = cluster.gpu.gpus_per_node
    kept = [s for s in splits if s[0] <= node] or splits
    cp = f" x cp={result.cp}" if result.cp > 1 else ""
    result.skipped += [
        f"tp={tp}{cp} x dp={dp}: a tp group wider than a node ({node} GPUs)"
        for tp, dp in splits
        if (tp, dp) not in kept
    ]
    for i, (tp, dp) in enumerate(reversed(kept)):
        where = f"(split {i + 1} of {len(kept)})"
        _say(progress, f"simulating tp={tp}{cp} x dp={dp}{', activation checkpointing' if ac else ''} {where}")
        est = run(tp=tp, dp=dp, activation_checkpointing=ac)
        result.estimates.append(est)
        if ac or fits(est, memory):
            continue
        bound = predict(est, cluster).tokens_per_second_per_gpu
        if result.ranking() and bound <= result.best_speed():
            result.skipped.append(
                f"{layout_name(est)} with activation checkpointing: at most {bound:,.0f} tokens/s per GPU "
                f"(its speed without recompute), below the best that fits"
            )
            continue
        _say(progress, f"simulating tp={tp}{cp} x dp={dp}, activation checkpointing {where}")
        result.estimates.append(run(tp=tp, dp=dp, activation_checkpointing=True))


def compute_bound(est: Estimate, speed: Speed) -> float:
    """Tokens/s per GPU that ``est``'s layout cannot exceed at any batch: its matmul and attention
    time per token does not shrink with the batch, and everything else only adds to it."""
    busy = speed.seconds.get("matmul", 0.0) + speed.seconds.get("attention", 0.0)
    return tokens_per_gpu(est) / busy if busy else float("inf")


def grow_batch(result: Sweep, est: Estimate, run: Callable[..., Estimate], progress: Progress) -> None:
    """Simulate ``est``'s layout at the largest doubled batch its memory allows (see the module
    docstring); every simulated batch joins ``result``, fitting or not."""
    memory, b0 = result.gpu_memory, est.batch_size
    candidates = [b0 * 2**k for k in range(1, MAX_BATCH_FACTOR.bit_length())]
    per_row = (est.peak.activations + est.peak.temporary) / b0  # first guess: bytes per added sequence
    for _ in range(BATCH_TRIES):
        target = next_batch(est, candidates, per_row, memory)
        if target is None:
            return
        _say(
            progress,
            f"simulating {layout_name(est)}{', activation checkpointing' if est.activation_checkpointing else ''}, "
            f"batch {target} ({headroom(est, memory):.1f} GiB left at batch {b0})",
        )
        grown = run(tp=est.tp, dp=est.dp, activation_checkpointing=est.activation_checkpointing, batch_size=target)
        result.estimates.append(grown)
        ok = fits(grown, memory)
        candidates = [b for b in candidates if (b > target if ok else b < target)]
        per_row = max(0.0, (grown.peak.total - est.peak.total) / (target - b0))


def next_batch(est: Estimate, candidates: list[int], per_row: float, gpu_memory: int) -> int | None:
    """The largest of ``candidates`` whose peak, ``est``'s plus ``per_row`` bytes per added
    sequence, fits ``gpu_memory`` (None if none does)."""
    fitting = [b for b in candidates if usable_peak(est.peak.total + (b - est.batch_size) * per_row, gpu_memory) >= 0]
    return max(fitting, default=None)


def _say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)
