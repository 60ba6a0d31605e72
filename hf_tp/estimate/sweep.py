"""Choosing a layout for a number of GPUs: which layouts a sweep simulates, which of them fit, how
they rank, and the recommendation.

Without a named GPU, the rule: every valid (tp, dp) split at the given batch, and among those whose
peak fits, the smallest tp. Tensor parallelism puts collectives of the activations (all-gather +
reduce-scatter, twice per layer, forward and backward) on the critical path of every layer, and
their volume grows with the tokens; FSDP's parameter all-gathers and gradient reduce-scatters
overlap with compute and do not depend on the tokens. So tp is worth its cost only when memory
requires it. ``cp`` and ``ep`` are fixed for a sweep: the splits are of world_size / cp ranks.

With a named GPU (``cluster``, :func:`speed_sweep`), the layouts that fit are ranked by predicted
tokens/s per GPU (:mod:`hf_tp.estimate.speed`). Besides the (tp, dp) splits (``cp`` and ``ep`` as
given):

- tp groups wider than a node are left out (TP's per-layer collectives would cross the network);
- activation checkpointing is simulated where a layout does not fit without it, unless its speed
  without recompute (an upper bound) already loses to a layout that fits;
- the per-rank batch is doubled, up to :data:`MAX_BATCH_FACTOR` x the given one, into the memory a
  fitting layout leaves. Larger batches only amortise more (FSDP's traffic hides behind more
  compute, per-call latencies spread over more tokens), so each layout gets its largest batch that
  fits, found in at most :data:`BATCH_TRIES` simulations: a first guess from the peak's activations
  and temporaries (the parts that grow with the batch), then a straight line through the two
  simulated peaks. A layout is not grown when even an unlimited batch could not beat the best one
  (its matmul and attention time per token alone is slower);
- HSDP (``dp_replicate``): where a stage's tp x dp ranks span several nodes, the FSDP2 shard group
  fills one node (``gpus_per_node / tp`` ranks) and the replicas, one per node, all-reduce the
  gradients across the network once per reduce-scatter, instead of FSDP2's gathers crossing it;
- pipeline parallelism (``pp``): 2, 4, 8 and 16 stages (powers of two dividing the world, each
  stage at least one node, at most :data:`MAX_PP`), where ``hf-tp train --pp`` can cut the model
  (no wrapper, as training refuses it) into at least one layer per stage; the sweep's cp and ep
  apply inside each stage (each stage's (tp, dp) split one its cp and ep can take; no HSDP with
  them), a tied ``lm_head`` is held by the first and the last stage. Two schedules: 1F1B, and Interleaved 1F1B with 2 stages
  per rank where the layers allow. The micro-batch is the sweep's ``batch_size`` and a dp rank runs
  ``microbatches`` of them: ``MAX_BATCH_FACTOR x pp`` (a step then holds as many rows over the world
  as a pp 1 layout at its largest batch), or, with the batch fixed (``--layout auto``), the most
  micro-batches, a multiple of pp, that split ``batch_size`` evenly. Under 1F1B more micro-batches
  cost no memory (a rank holds at most pp in flight) and shrink the bubble.

Each HSDP and pipeline layout is estimated from one simulated stage (:mod:`hf_tp.estimate.layouts`);
layouts that simulate the same stage share one simulation (a cache keyed by the simulated config
and shape).

Fast by default: each layout is estimated from short runs of the model extended to its depth
(:mod:`hf_tp.estimate.depth`; a pipeline layout's stage alike), and the best is then checked
(:func:`verify_best`): at every layer, or one period deeper than the short runs (the extension
must predict that run exactly, else every layer is simulated); where the checked layout does not
fit, the next is checked the same way. The simulations run in worker processes where the sweep is
given ``jobs`` > 1, the first round of layouts queued ahead.

What a sweep finds (:class:`Sweep`): the layouts it simulated, which fit a GPU's memory
(:func:`fits`, with the margins of :data:`RULE`) and how the fitting ones rank by predicted speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.core.dims import check_cp_rows, check_expert_ranks, row_multiple
from hf_tp.estimate.depth import Simulations, Simulator, estimate_fast
from hf_tp.estimate.estimate_run import Estimate, estimate_spec
from hf_tp.estimate.layouts import Simulate, SimulationCache, estimate_layout, stage_config, stage_plan
from hf_tp.estimate.spec import EstimateSpec, GiB, validate
from hf_tp.estimate.speed import Cluster, Speed, predict, tokens_per_gpu

BATCH_TRIES = 2

Progress = Callable[[str], None] | None


def speed_sweep(
    result: Sweep,
    splits: list[SweepCandidate] | list[tuple[int, int]],
    run: Callable[..., Estimate],
    ac: bool,
    progress: Progress,
    grow: bool = True,
) -> None:
    """Simulate ``splits`` (largest tp first), grow the batch of those that fit (unless ``grow`` is
    False; a pipeline layout's micro-batch count is its growth), recommend the fastest."""
    simulate_splits(
        result, [s if isinstance(s, SweepCandidate) else SweepCandidate(*s) for s in splits], run, ac, progress
    )
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
    result: Sweep, splits: list[SweepCandidate], run: Callable[..., Estimate], ac: bool, progress: Progress
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
    for lay in kept if hasattr(run, "prefetch") else ():  # every such layout is simulated (HSDP may be pruned)
        if lay.dp_replicate == 1:
            run.prefetch(**lay.changes(), activation_checkpointing=ac)
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


def hsdp_pruned(result: Sweep, lay: SweepCandidate) -> str | None:
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


def _plain_name(lay: SweepCandidate, cp: str) -> str:
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
class SweepCandidate:
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
        plain = SweepCandidate(self.tp, self.dp)
        return {k: v for k, v in dataclasses.asdict(self).items() if k in ("tp", "dp") or v != getattr(plain, k)}


def layout_of(est: Estimate) -> SweepCandidate:
    """The layout ``est`` was estimated at."""
    return SweepCandidate(
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


def hsdp_layouts(layouts: list[SweepCandidate], gpus_per_node: int) -> list[SweepCandidate]:
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
) -> list[SweepCandidate]:
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
                out.append(SweepCandidate(tp, dp, pp, 1, m, schedule, v, batch))
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
    verify: str = "full",
    jobs: int = 1,
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
    runs, then checks the best ``verified`` layouts (:func:`verify_best`): at every layer
    (``verify="full"``) or one period past the short runs (``verify="check"``, :data:`hf_tp.estimate.depth.CHECK`);
    ``fast=False`` simulates every layout at every layer. ``jobs`` > 1 runs the simulations in that
    many worker processes (:class:`hf_tp.estimate.depth.Simulations`)."""
    spec = spec or EstimateSpec(tp=1, dp=1, **named)
    validate(config, spec.replace(tp=1, dp=spec.ep, dp_replicate=1))  # sizes, positions, ep and cp, once
    if cluster is not None:
        cluster.gpu.peak_flops(spec.dtype)  # a GPU without a published peak for dtype fails before simulating
        gpu_memory = gpu_memory or cluster.gpu.memory_bytes
    result = Sweep(world_size=world_size, gpu_memory=gpu_memory, ep=spec.ep, cluster=cluster, cp=spec.cp)
    splits = cp_splits(config, world_size, spec.seq_len, spec.ep, spec.cp, result.skipped)
    with Simulations(jobs) as sims:
        run = Runner(config, spec, model_name, SimulationCache(simulate or Simulator(sims, fast)))
        if cluster is not None:
            node = cluster.gpu.gpus_per_node
            plain = [SweepCandidate(tp, dp) for tp, dp in splits]
            layouts = plain + hsdp_layouts(plain, node) if spec.cp == 1 and spec.ep == 1 else plain
            stages = pipeline_layouts(
                config, world_size, spec, node, grow, lambda n: candidate_splits(config, n), result.skipped,
                pp_schedules,
            )  # fmt: skip
            layouts += stages + (hsdp_layouts(stages, node) if spec.cp == 1 and spec.ep == 1 else [])
            speed_sweep(result, layouts, run, spec.activation_checkpointing, progress, grow)
        else:
            cp = f" x cp={spec.cp}" if spec.cp > 1 else ""
            for tp, dp in splits:
                run.prefetch(tp=tp, dp=dp)
            for i, (tp, dp) in enumerate(splits):
                _say(progress, f"simulating tp={tp}{cp} x dp={dp} (split {i + 1} of {len(splits)})")
                result.estimates.append(run(tp=tp, dp=dp))
            result.recommended = recommend(result.estimates, gpu_memory)
        checker = Simulator(sims, fast=verify == "check", check=verify == "check")
        verify_best(result, config, model_name, progress, verified, checker)
    return result


@dataclass
class Runner:
    """One layout of the sweep's ``spec`` estimated (``run(tp=..., dp=..., ...)``, the spec's fields
    changed) through the sweep's ``cache``; :meth:`prefetch` queues its simulation."""

    config: PretrainedConfig
    spec: EstimateSpec
    model_name: str | None
    cache: SimulationCache

    def __call__(self, **changes) -> Estimate:
        return estimate_layout(self.config, self.spec.replace(**changes), self.model_name, self.cache)

    def prefetch(self, **changes) -> None:
        self.cache.prefetch(self.config, self.spec.replace(**changes), self.model_name)


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
    result: Sweep,
    config: PretrainedConfig,
    model_name: str | None,
    progress: Progress,
    count: int = 1,
    simulate: Simulator | None = None,
) -> None:
    """Check the best ``count`` layouts that were estimated from short runs, replacing their
    estimates, until the best ``count`` are all checked (a layout that no longer fits drops out,
    and the next is checked); then recommend the best. ``simulate`` checks one stage: at every
    layer (the default), or one period past the short runs (``Simulator(check=True)``: the
    extension kept where it predicts that run exactly, else every layer simulated)."""
    simulate = simulate or Simulator(Simulations(), fast=False)
    cache = SimulationCache(simulate)
    while todo := [e for e in ordered(result)[:count] if _unchecked(e, simulate)]:
        for est in todo if len(todo) > 1 else ():  # (in parallel where the simulations have workers)
            cache.prefetch(config, est.spec, model_name)
        for est in todo:
            ac = ", activation checkpointing" if est.activation_checkpointing else ""
            how = ("checking", "one period deeper") if simulate.check else ("simulating", "at every layer")
            _say(progress, f"{how[0]} {describe_layout(est)}{ac}, batch {est.batch_size}, {how[1]} (the best)")
            at = next(i for i, e in enumerate(result.estimates) if e is est)
            result.estimates[at] = estimate_layout(config, est.spec, model_name, cache)
    best = ordered(result)
    result.recommended = best[0] if best else None


def _unchecked(est: Estimate, simulate: Simulator) -> bool:
    """Whether ``est`` is still to be checked: extended from short runs, and not yet checked one
    period deeper where that is the check."""
    return len(est.extended_from) == 2 if simulate.check else bool(est.extended_from)


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
