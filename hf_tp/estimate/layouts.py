"""Every layout ``hf-tp train`` runs, from one simulated stage: pipeline parallelism (``pp``) and HSDP
(``dp_replicate``) by arithmetic on the simulation of what one rank runs.

What is simulated (:data:`Simulate`, :func:`hf_tp.estimate.api.estimate_spec` by default) is one
rank of one stage: the busiest rank's decoder layers (:mod:`hf_tp.estimate.pipeline`) with the
embedding, final norm and lm_head all kept (a bound: a real stage holds the embedding only on the
first stage, the head and logits only on the last), one micro-batch's rows (``batch_size /
microbatches``), tp x cp x the FSDP2 shard group's ranks. Its result depends on neither pp's
schedule nor the micro-batch count nor the replicas, so one simulation serves every such layout
(:class:`SimulationCache`, keyed by the simulated config and shape). Then:

- HSDP (:func:`replicated`): a rank of R replicas x an FSDP2 shard group of S > 1 holds what a rank
  of plain FSDP2 over S holds (S = 1, pure replication, is simulated as HSDP itself); FSDP2 adds one all-reduce across the replicas per reduce-scatter, of
  its output (the shard), and collectives over every dp rank (a router's gradient) span R x S;
- pipeline (:func:`staged`): the peak adds the larger of the first rank's ``in_flight - 1`` more
  micro-batches' saved activations (the simulated peak's activations each: a bound, they include
  one micro-batch's loss chunk) and the last rank's, with its loss on whole logits per micro-batch
  it holds (``hf-tp train --pp``'s last stage computes transformers' loss on a micro-batch's whole
  logits, not hf_tp's fused lm_head + loss: :data:`HELD_LOGIT_BYTES` per logit of the tp shard
  kept to the backward, :data:`BACKWARD_LOGIT_BYTES` more for one micro-batch's backward);
  every per-micro-batch collective and kernel runs ``microbatches`` times (FSDP2 gathers and
  reduce-scatters each micro-batch: torch's pipeline stage is not the FSDP2 module here), AdamW and
  the gradient norm once; each micro-batch's boundary activations go to the next stage and their
  gradients come back (``pp`` send_recv: this rank's tp x cp shard of a micro-batch's hidden
  states, 2 x V x M messages); a MoE whose aux loss hf_tp computes over the step adds the routing
  pass (a no-grad forward: a third of the matmul and attention work). Parameters and MFU's model
  FLOPs are the whole model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from transformers import PretrainedConfig

from hf_tp.estimate.api import Estimate, estimate_spec
from hf_tp.estimate.counters import _RING_FACTOR, CommStat, Work
from hf_tp.estimate.pipeline import StagePlan, config_key, in_flight, last_in_flight, stage_config, stage_plan
from hf_tp.estimate.spec import BYTES, EstimateSpec, validate
from hf_tp.gpus import model_flops_per_token

Simulate = Callable[[PretrainedConfig, EstimateSpec, "str | None"], Estimate]
ONCE_PER_STEP_OPS = ("_fused_adamw_", "_fused_adam_")  # the optimizer's kernels: once per step, not per micro-batch
# The last stage's loss on whole logits, per logit of the tp shard: kept from a micro-batch's forward
# to its backward, the logits (stage output) and log_softmax's fp32 output (4 + 4: a bound for
# bf16's 2 + 4); in its backward, the fp32 copy and the gradient (docs/scale.md measures them)
HELD_LOGIT_BYTES = 8
BACKWARD_LOGIT_BYTES = 8


class SimulationCache:
    """Simulated stages by (config, spec): layouts that simulate the same thing share one run."""

    def __init__(self, simulate: Simulate | None = None) -> None:
        self.simulate = simulate or estimate_spec
        self.runs: dict[tuple[str, EstimateSpec], Estimate] = {}
        self.hits = 0

    def __call__(self, config: PretrainedConfig, spec: EstimateSpec, model_name: str | None) -> Estimate:
        key = (config_key(config), spec)
        if key in self.runs:
            self.hits += 1
        else:
            self.runs[key] = self.simulate(config, spec, model_name)
        return self.runs[key]


def estimate_layout(
    config: PretrainedConfig,
    spec: EstimateSpec,
    model_name: str | None = None,
    simulate: Simulate | None = None,
) -> Estimate:
    """One rank's memory, collectives and work for one step of ``spec`` (pp and HSDP included):
    the simulated stage (``simulate``: :func:`hf_tp.estimate.api.estimate_spec`, or a
    :class:`SimulationCache`) with the arithmetic of the module docstring."""
    validate(config, spec)
    simulate = simulate or estimate_spec
    # HSDP from its shard group's simulation; a shard group of 1 (replicas only) has no reduce-scatter
    # to derive the all-reduce from, and is simulated as HSDP itself
    derive = 1 < spec.dp_replicate < spec.dp
    if spec.pp == 1 and not derive:
        return simulate(config, spec, model_name)
    name = model_name or getattr(config, "name_or_path", "") or config.model_type
    plan = stage_plan(config, spec.pp * spec.pp_virtual_stages) if spec.pp > 1 else None
    layers = plan.rank_layers(spec.pp, plan.busiest_rank(spec.pp)) if plan else []
    simulated = stage_config(config, plan, layers) if plan else config
    replicas = spec.dp_replicate if derive else 1
    shard = spec.replace(
        dp=spec.dp // replicas, dp_replicate=spec.dp_replicate // replicas, batch_size=spec.batch_size // spec.microbatches,
        pp=1, pp_schedule="1f1b", pp_virtual_stages=1, microbatches=1,
    )  # fmt: skip
    est = simulate(simulated, shard, name)
    if derive:
        est = replicated(est, replicas)
    if plan is not None:
        est = staged(est, spec, plan, len(layers), config)
    return est


def _stat(dim: str, collective: str, group: int, count: int, nbytes: int) -> CommStat:
    return CommStat(dim, collective, group, count, nbytes, int(nbytes * _RING_FACTOR[collective](group)))


def replicated(est: Estimate, replicas: int) -> Estimate:
    """``est`` (plain FSDP2 over its dp ranks) as one rank of ``replicas`` x that shard group (HSDP)."""
    shard, dp = est.dp, est.dp * replicas
    world = est.tp * est.cp * dp
    comms = []
    for c in est.comms:
        if c.dim == "dp" and c.collective == "all_reduce":  # not FSDP2's: over every dp rank
            comms.append(_stat("dp_all", c.collective, dp, c.count, c.bytes))
        elif c.dim == "world":
            comms.append(_stat("world", c.collective, world, c.count, c.bytes))
        else:
            comms.append(c)
    scatter = next((c for c in est.comms if c.dim == "dp" and c.collective == "reduce_scatter"), None)
    if scatter is not None:
        comms.append(_stat("dp_replicate", "all_reduce", replicas, scatter.count, scatter.bytes // shard))
    return dataclasses.replace(
        est, dp=dp, dp_replicate=replicas, comms=sorted(comms, key=lambda c: (c.dim, c.collective))
    )


def staged(est: Estimate, spec: EstimateSpec, plan: StagePlan, layers: int, config: PretrainedConfig) -> Estimate:
    """``est`` (one micro-batch of the busiest rank's layers) as that rank's whole pipeline step."""
    m, v = spec.microbatches, spec.pp_virtual_stages
    held = in_flight(spec.pp_schedule, spec.pp, m, v)
    rows = spec.batch_size // m
    logits = rows * spec.seq_len * config.vocab_size // spec.tp
    last, copies = last_in_flight(spec.pp_schedule, spec.pp, m, v)
    at_last = (last - 1) * est.peak.activations + logits * (copies * HELD_LOGIT_BYTES + BACKWARD_LOGIT_BYTES)
    extra = int(max((held - 1) * est.peak.activations, at_last))
    peak = dataclasses.replace(est.peak, activations=est.peak.activations + extra)
    world = spec.world_size
    comms = [
        _stat("world", c.collective, world, c.count, c.bytes)
        if c.dim == "world"
        else CommStat(c.dim, c.collective, c.group_size, c.count * m, c.bytes * m, c.sent_bytes * m)
        for c in est.comms
    ]
    message = rows * spec.seq_len * config.hidden_size * BYTES[spec.dtype] // (spec.tp * spec.cp)
    count = 2 * v * m
    comms.append(CommStat("pp", "send_recv", spec.pp, count, count * message, count * message))
    routing = plan.aux_loss
    return dataclasses.replace(
        est,
        peak=peak,
        comms=comms,
        work=_per_step_work(est.work, m, routing),
        num_params=plan.num_params,
        model_flops_per_token=model_flops_per_token(config, plan.num_params, spec.seq_len, plan.unrouted_params),
        batch_size=spec.batch_size,
        pp=spec.pp,
        pp_schedule=spec.pp_schedule,
        pp_virtual_stages=v,
        microbatches=m,
        stage_layers=layers,
        in_flight=held,
        routing_pass=routing,
        trainable_params=est.trainable_params * plan.num_params // max(est.num_params, 1),
    )


def _per_step_work(work: Work | None, microbatches: int, routing: bool) -> Work | None:
    """One micro-batch's work run ``microbatches`` times (the optimizer's kernels once), plus a
    routing pass's forward (a third of the matmul and attention work, without recompute)."""
    if work is None:
        return None
    once = sum(b for op, b in work.by_op.items() if op in ONCE_PER_STEP_OPS)
    fwd = 1 - work.recompute_flops / max(1, work.matmul_flops + work.attention_flops)
    extra = (lambda flops: int(flops * fwd / 3)) if routing else (lambda flops: 0)
    matmul, attention = work.matmul_flops * microbatches, work.attention_flops * microbatches
    return dataclasses.replace(
        work,
        matmul_flops=matmul + extra(matmul),
        attention_flops=attention + extra(attention),
        recompute_flops=work.recompute_flops * microbatches + extra(matmul) + extra(attention),
        memory_bytes=(work.memory_bytes - once) * microbatches + once,
        memory_kernels=work.memory_kernels * microbatches,
        by_op={op: b if op in ONCE_PER_STEP_OPS else b * microbatches for op, b in work.by_op.items()},
    )
