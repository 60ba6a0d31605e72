"""The sweep's search on a named GPU: which layouts to simulate, ranked by predicted tokens/s.

Three dimensions besides the (tp, dp) split (``cp`` and ``ep`` stay as given):

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
"""

from __future__ import annotations

from collections.abc import Callable

from hf_tp.estimate.api import Estimate
from hf_tp.estimate.layouts import Sweep, fits, headroom, usable_peak
from hf_tp.estimate.speed import Speed, predict, tokens_per_gpu

MAX_BATCH_FACTOR = 8
BATCH_TRIES = 2

Progress = Callable[[str], None] | None


def layout_name(est: Estimate) -> str:
    """``tp=2 x dp=4`` (``tp=2 x cp=2 x dp=4`` with context parallelism)."""
    return f"tp={est.tp}{f' x cp={est.cp}' if est.cp > 1 else ''} x dp={est.dp}"


def speed_sweep(
    result: Sweep, splits: list[tuple[int, int]], run: Callable[..., Estimate], ac: bool, progress: Progress
) -> None:
    """Simulate ``splits`` (largest tp first), grow the batch of those that fit, recommend the fastest."""
    simulate_splits(result, splits, run, ac, progress)
    for est, speed in list(result.ranking()):  # fastest first, so the bound below prunes the most
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
