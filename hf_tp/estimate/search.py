"""The search a sweep on a named GPU runs (see :mod:`hf_tp.estimate.sweep`): every layout at the
given batch, activation checkpointing where one does not fit, the batch grown into the memory left.

The layouts a speed sweep tries besides the (tp, dp) splits: HSDP and pipeline parallelism.

- HSDP (``dp_replicate``): where a stage's tp x dp ranks span several nodes, the FSDP2 shard group
  fills one node (``gpus_per_node / tp`` ranks) and the replicas, one per node, all-reduce the
  gradients across the network once per reduce-scatter, instead of FSDP2's gathers crossing it.
- Pipeline parallelism (``pp``): 2, 4, 8 and 16 stages (powers of two dividing the world, each
  stage at least one node, at most :data:`MAX_PP`), where ``hf-tp train --pp`` can cut the model
  (no wrapper, as training refuses it) into at least one layer per stage; the sweep's cp and ep
  apply inside each stage (each stage's (tp, dp) split one its cp and ep can take), a tied
  ``lm_head`` is held by the first and the last stage. Two schedules: 1F1B, and Interleaved 1F1B with 2 stages per rank where the layers
  allow. The micro-batch is the sweep's ``batch_size`` and a dp rank runs ``microbatches`` of them:
  ``MAX_BATCH_FACTOR x pp`` (a step then holds as many rows over the world as a pp 1 layout at its
  largest batch), or, with the batch fixed (``--layout auto``), the most micro-batches, a multiple
  of pp, that split ``batch_size`` evenly. Under 1F1B more micro-batches cost no memory (a rank
  holds at most pp in flight) and shrink the bubble.

What a sweep finds: the layouts it simulated, which fit a GPU's memory (:func:`fits`, with the
margins of :data:`RULE`) and how the fitting ones rank by predicted speed (:class:`Sweep`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from hf_tp.estimate.api import Estimate
from hf_tp.estimate.layouts import stage_config, stage_plan
from hf_tp.estimate.spec import EstimateSpec, GiB
from hf_tp.estimate.speed import Cluster, Speed, predict, tokens_per_gpu
from hf_tp.layout import check_cp_rows, check_expert_ranks

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


MAX_PP = 16
MAX_BATCH_FACTOR = 8  # a sweep grows a dp rank's batch up to this x the given one
SCHEDULES = ("1f1b", "interleaved1f1b")  # what a sweep tries (interleaved with 2 stages per rank)


@dataclass(frozen=True)
class Layout:
    """One layout a sweep simulates (the spec's other fields stay)."""

    tp: int
    dp: int
    pp: int = 1
    dp_replicate: int = 1
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    batch_size: int | None = None  # None: the sweep's

    def changes(self) -> dict:
        """tp, dp and the fields that differ from a plain (tp, dp) split's."""
        plain = Layout(self.tp, self.dp)
        return {k: v for k, v in dataclasses.asdict(self).items() if k in ("tp", "dp") or v != getattr(plain, k)}


def layout_of(est: Estimate) -> Layout:
    """The layout ``est`` was estimated at."""
    return Layout(
        est.tp, est.dp, est.pp, est.dp_replicate, est.microbatches, est.pp_schedule, est.pp_virtual_stages,
        est.batch_size,
    )  # fmt: skip


def describe_layout(est: Estimate) -> str:
    """``tp=2 x dp=4``, with ``cp=``, ``pp=`` (its schedule and micro-batches) and HSDP's split."""
    pp = ""
    if est.pp > 1:
        v = f" x{est.pp_virtual_stages}" if est.pp_virtual_stages > 1 else ""
        pp = f"pp={est.pp} ({est.pp_schedule}{v}, {est.microbatches} micro-batches) x "
    cp = f" x cp={est.cp}" if est.cp > 1 else ""
    dp = f"dp={est.dp}" + (f" (HSDP {est.dp_replicate} x {est.dp // est.dp_replicate})" if est.dp_replicate > 1 else "")
    return f"{pp}tp={est.tp}{cp} x {dp}"


def hsdp_layouts(layouts: list[Layout], gpus_per_node: int) -> list[Layout]:
    """Each layout whose stage's tp x dp ranks span nodes, again as HSDP with a node-sized shard group."""
    out = []
    for lay in layouts:
        shard = gpus_per_node // lay.tp if gpus_per_node % lay.tp == 0 else 0
        if lay.dp_replicate == 1 and shard and lay.tp * lay.dp > gpus_per_node and lay.dp % shard == 0:
            out.append(dataclasses.replace(lay, dp_replicate=lay.dp // shard))
    return out


def pipeline_layouts(
    config: PretrainedConfig,
    world: int,
    spec: EstimateSpec,
    gpus_per_node: int,
    grow: bool,
    splits_of,
    skipped: list[str],
    schedules: tuple[str, ...] = SCHEDULES,
) -> list[Layout]:
    """The pipeline layouts of ``world`` ranks (see the module docstring); ``splits_of(ranks)``
    gives the (tp, dp) splits of a stage's ranks. Why none are tried goes to ``skipped``."""
    cp = spec.cp
    sizes = [2**k for k in range(1, MAX_PP.bit_length()) if world % (2**k * cp) == 0 and world // 2**k >= gpus_per_node]
    if not sizes or not schedules:
        return []
    try:
        stage_plan(config, 1)  # the model's own refusals (wrappers, forwards that change the stream, ...)
    except ValueError as exc:
        skipped.append(f"pipeline layouts: {exc}")
        return []
    layers = config.num_hidden_layers
    out = []
    for pp in (p for p in sizes if p <= layers):
        micro = _microbatches(pp, spec.batch_size, grow)
        if micro is None:
            skipped.append(
                f"pp={pp}: --batch-size {spec.batch_size} does not split into a multiple of {pp} micro-batches"
            )
            continue
        m, batch = micro
        tried = [(s, 2 if s == "interleaved1f1b" else 1) for s in schedules if s == "1f1b" or 2 * pp <= layers]
        tried = [(s, v) for s, v in tried if _cuttable(config, pp, v, skipped)]
        for tp, dp in _stage_splits(spec, splits_of(world // (pp * cp)), pp, skipped):
            for schedule, v in tried:
                out.append(Layout(tp, dp, pp, 1, m, schedule, v, batch))
    return out


def _stage_splits(
    spec: EstimateSpec, splits: list[tuple[int, int]], pp: int, skipped: list[str]
) -> list[tuple[int, int]]:
    """The (tp, dp) splits of a stage's ranks that its cp and ep can take (as at pp 1: ep divides
    dp x cp, rows a multiple of 2 x cp x tp); the others noted in ``skipped``."""
    kept = []
    for tp, dp in splits:
        try:
            check_expert_ranks(dp, spec.cp, spec.ep)
            check_cp_rows(spec.seq_len, tp, spec.cp)
        except ValueError as exc:
            skipped.append(f"pp={pp} x tp={tp} x cp={spec.cp} x dp={dp}: {exc}")
            continue
        kept.append((tp, dp))
    return kept


def _cuttable(config: PretrainedConfig, pp: int, virtual: int, skipped: list[str]) -> bool:
    """Whether the busiest rank's layers of ``pp x virtual`` stages can be sized (noted in ``skipped`` if not)."""
    plan = stage_plan(config, pp * virtual)
    try:
        stage_config(config, plan, plan.rank_layers(pp, plan.busiest_rank(pp)))
    except ValueError as exc:
        skipped.append(f"pp={pp} x {virtual} stages per rank: {exc}")
        return False
    return True


def _microbatches(pp: int, batch: int, grow: bool) -> tuple[int, int] | None:
    """(micro-batches, a dp rank's rows) of a pipeline layout, or None if ``batch`` cannot be split."""
    if grow:
        return MAX_BATCH_FACTOR * pp, MAX_BATCH_FACTOR * pp * batch
    fitting = [m for m in range(pp, batch + 1, pp) if batch % m == 0]
    return (max(fitting), batch) if fitting else None


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
