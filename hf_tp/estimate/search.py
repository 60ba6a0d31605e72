"""The search a sweep on a named GPU runs (see :mod:`hf_tp.estimate.sweep`): every layout at the
given batch, activation checkpointing where one does not fit, the batch grown into the memory left."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hf_tp.estimate.api import Estimate
from hf_tp.estimate.candidates import MAX_BATCH_FACTOR, Layout, describe_layout, layout_of
from hf_tp.estimate.ranking import Sweep, fits, headroom, usable_peak
from hf_tp.estimate.speed import Speed, predict, tokens_per_gpu

BATCH_TRIES = 2

Progress = Callable[[str], None] | None


def speed_sweep(
    result: Sweep,
    splits: list[Layout] | list[tuple[int, int]],
    run: Callable[..., Estimate],
    ac: bool,
    progress: Progress,
    grow: bool = True,
) -> None:
    """Simulate ``splits`` (largest tp first), grow the batch of those that fit (unless ``grow`` is
    False; a pipeline layout's micro-batch count is its growth), recommend the fastest."""
    simulate_splits(result, [s if isinstance(s, Layout) else Layout(*s) for s in splits], run, ac, progress)
    for est, speed in list(result.ranking()) if grow else []:  # fastest first: the bound below prunes the most
        if est.pp > 1:
            continue
        bound = compute_bound(est, speed)
        if bound <= result.best_speed():  # (the best layout's bound is above its own speed)
            result.skipped.append(
                f"{describe_layout(est)} at a batch above {est.batch_size}: at most {bound:,.0f} tokens/s per GPU "
                "(its matmul and attention time alone), below the best that fits"
            )
            continue
        grow_batch(result, est, run, progress)
    ranked = result.ranking()
    result.recommended = ranked[0][0] if ranked else None


def simulate_splits(
    result: Sweep, splits: list[Layout], run: Callable[..., Estimate], ac: bool, progress: Progress
) -> None:
    """Each layout at the given batch, again with activation checkpointing where it does not fit
    (unless its speed without recompute already loses); tp wider than a node left out. The plain
    (tp, dp) splits go largest tp first, then HSDP and pipeline layouts."""
    cluster, memory = result.cluster, result.gpu_memory
    node = cluster.gpu.gpus_per_node
    kept = [s for s in splits if s.tp <= node] or splits
    cp = f" x cp={result.cp}" if result.cp > 1 else ""
    result.skipped += [
        f"tp={s.tp}{cp} x dp={s.dp}: a tp group wider than a node ({node} GPUs)"
        for s in splits
        if s not in kept and s.pp == 1 and s.dp_replicate == 1
    ]
    plain = [s for s in kept if s.pp == 1 and s.dp_replicate == 1]
    kept = plain[::-1] + [s for s in kept if s not in plain]
    for i, lay in enumerate(kept):
        where = f"(split {i + 1} of {len(kept)})"
        name = _plain_name(lay, cp)
        if (why := hsdp_pruned(result, lay)) is not None:
            result.skipped.append(f"{name}: {why}")
            continue
        _say(progress, f"simulating {name}{', activation checkpointing' if ac else ''} {where}")
        est = run(**lay.changes(), activation_checkpointing=ac)
        result.estimates.append(est)
        if ac or fits(est, memory):
            continue
        bound = predict(est, cluster).tokens_per_second_per_gpu
        if result.ranking() and bound <= result.best_speed():
            result.skipped.append(
                f"{describe_layout(est)} with activation checkpointing: at most {bound:,.0f} tokens/s per GPU "
                f"(its speed without recompute), below the best that fits"
            )
            continue
        _say(progress, f"simulating {name}, activation checkpointing {where}")
        result.estimates.append(run(**lay.changes(), activation_checkpointing=True))


def hsdp_pruned(result: Sweep, lay: Layout) -> str | None:
    """Why HSDP layout ``lay`` need not be simulated, or None: a rank of it holds more than one of
    its plain FSDP2 counterpart (the state sharded over a node, not over every dp rank), so it
    cannot fit where that one does not even with checkpointing, and it can at most remove that
    one's exposed FSDP2 time."""
    if lay.dp_replicate == 1:
        return None
    plain = dataclasses.replace(lay, dp_replicate=1)
    twins = [e for e in result.estimates if layout_of(e) == dataclasses.replace(plain, batch_size=e.batch_size)]
    if not twins or plain.batch_size not in (None, twins[0].batch_size):
        return None
    fitting = [e for e in twins if fits(e, result.gpu_memory)]
    if not fitting and any(e.activation_checkpointing for e in twins):
        return "its FSDP2 counterpart does not fit even with checkpointing, and HSDP holds more per rank"
    if not fitting:
        return None
    best = result.best_speed()
    bounds = []
    for e in fitting:
        speed = predict(e, result.cluster)
        dp = sum(v for k, v in speed.seconds.items() if k.split()[0] in ("dp", "dp_out", "dp_all", "dp_replicate"))
        bounds.append(speed.tokens_per_second_per_gpu * speed.step_seconds / (speed.step_seconds - dp))
    if best and max(bounds) <= best:
        return f"at most {max(bounds):,.0f} tokens/s per GPU (its FSDP2 counterpart without exposed FSDP2 time), below the best that fits"
    return None


def _plain_name(lay: Layout, cp: str) -> str:
    pp = f"pp={lay.pp} ({lay.pp_schedule}, {lay.microbatches} micro-batches) x " if lay.pp > 1 else ""
    hsdp = f" (HSDP {lay.dp_replicate} x {lay.dp // lay.dp_replicate})" if lay.dp_replicate > 1 else ""
    return f"{pp}tp={lay.tp}{cp} x dp={lay.dp}{hsdp}"


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
            f"simulating {describe_layout(est)}{', activation checkpointing' if est.activation_checkpointing else ''}, "
            f"batch {target} ({headroom(est, memory):.1f} GiB left at batch {b0})",
        )
        changes = {**layout_of(est).changes(), "batch_size": target}
        grown = run(**changes, activation_checkpointing=est.activation_checkpointing)
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
