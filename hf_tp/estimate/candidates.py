"""The layouts a speed sweep tries besides the (tp, dp) splits: HSDP and pipeline parallelism.

- HSDP (``dp_replicate``): where a stage's tp x dp ranks span several nodes, the FSDP2 shard group
  fills one node (``gpus_per_node / tp`` ranks) and the replicas, one per node, all-reduce the
  gradients across the network once per reduce-scatter, instead of FSDP2's gathers crossing it.
- Pipeline parallelism (``pp``): 2, 4, 8 and 16 stages (powers of two dividing the world, each
  stage at least one node, at most :data:`MAX_PP`), where ``hf-tp train --pp`` can cut the model
  (no wrapper, as training refuses it; no cp or ep, which this estimate does not model with pp yet) into at least one layer
  per stage. Two schedules: 1F1B, and Interleaved 1F1B with 2 stages per rank where the layers
  allow. The micro-batch is the sweep's ``batch_size`` and a dp rank runs ``microbatches`` of them:
  ``MAX_BATCH_FACTOR x pp`` (a step then holds as many rows over the world as a pp 1 layout at its
  largest batch), or, with the batch fixed (``--layout auto``), the most micro-batches, a multiple
  of pp, that split ``batch_size`` evenly. Under 1F1B more micro-batches cost no memory (a rank
  holds at most pp in flight) and shrink the bubble.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import PretrainedConfig

from hf_tp.estimate.api import Estimate
from hf_tp.estimate.pipeline import stage_config, stage_plan
from hf_tp.estimate.spec import EstimateSpec

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
    sizes = [2**k for k in range(1, MAX_PP.bit_length()) if world % 2**k == 0 and world // 2**k >= gpus_per_node]
    if not sizes or not schedules:
        return []
    if spec.cp > 1 or spec.ep > 1:
        skipped.append("pipeline layouts: the estimate does not model --pp with --cp or --ep yet")
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
        for tp, dp in splits_of(world // pp):
            for schedule, v in tried:
                out.append(Layout(tp, dp, pp, 1, m, schedule, v, batch))
    return out


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
