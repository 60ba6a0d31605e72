"""Every layout ``hf-tp train`` runs, from one simulated stage: pipeline parallelism (``pp``) and HSDP
(``dp_replicate``) by arithmetic on the simulation of what one rank runs.

What is simulated (:data:`Simulate`, :func:`hf_tp.estimate.estimate_run.estimate_spec` by default) is one
rank of one stage: the busiest rank's decoder layers (:mod:`hf_tp.estimate.layouts`) with the
embedding, final norm and lm_head all kept (a bound: a real stage holds the embedding only on the
first stage, the head and logits only on the last), one micro-batch's rows (``batch_size /
microbatches``), tp x cp x the FSDP2 shard group's ranks, ep over the stage's dp x cp ranks as
``hf-tp train --pp`` does (ep 1 for a stage of dense layers only, which training runs without ep:
a model's first dense layers). A tied ``lm_head`` is one weight on the simulated stage, as on the
first and on the last stage, each of which holds it (the estimate's bound holds both ends
anyway); its gradient sum between them is counted below. Its result depends on neither pp's
schedule nor the micro-batch count nor the replicas, so one simulation serves every such layout
(:class:`SimulationCache`, keyed by the simulated config and shape). Then:

- HSDP (:func:`replicated`): a rank of R replicas x an FSDP2 shard group of S > 1 holds what a rank
  of plain FSDP2 over S holds (S = 1, pure replication, is simulated as HSDP itself); FSDP2 adds one all-reduce across the replicas per reduce-scatter, of
  its output (the shard), and collectives over every dp rank (a router's gradient) span R x S;
- pipeline (:func:`staged`): the peak adds the larger of the first rank's ``in_flight - 1`` more
  micro-batches' saved activations (the simulated peak's activations each: a bound, they include
  one micro-batch's loss chunk) and the last rank's, with its loss on whole logits per micro-batch
  it holds (``hf-tp train --pp``'s last stage computes transformers' loss on a micro-batch's whole
  logits of this rank's cp tokens, not hf_tp's fused lm_head + loss: :data:`HELD_LOGIT_BYTES` per
  logit of the tp shard kept to the backward, :data:`BACKWARD_LOGIT_BYTES` more for one
  micro-batch's backward);
  the stage's FSDP2 units accumulate unsharded gradients through the schedule's step and
  reduce-scatter once after it (:mod:`hf_tp.pipeline.pipeline_fsdp`), so from the first backward
  to the step's end the rank holds the stage's unsharded fp32 gradients (FSDP2's reduce dtype; a
  MoE's routed experts 1/ep of them, the rank's own) with the micro-batches then in flight, which
  the peak takes where it is larger; FSDP2's reduce-scatter (and HSDP's all-reduce of it; the
  experts' own units over ``dp_out``, inside the stage's root, alike) runs once per step, its all-gathers once per
  micro-batch's forward and backward plus one micro-batch more for the shape pass torch's schedule
  runs each step (a bound: a unit still gathered from a previous forward skips its gather), once
  per step under a V-shaped schedule (``zbv``, ``dualpipev``: the gathered weights, also added
  to the peak, are kept through the step); every other per-micro-batch collective (tp's, cp's K/V
  gathers and dK/dV reduce-scatters, ep's all-to-alls) runs ``microbatches + 1`` times (the shape
  pass runs one micro-batch's forward and its input-gradient backward more: measured exact on a
  last stage, a bound on a first, whose shape pass has no backward), every kernel ``microbatches``
  times, AdamW and the gradient norm once; each micro-batch's boundary activations go to the next
  stage and their gradients come back (``pp`` send_recv: this rank's tp x cp shard of a
  micro-batch's hidden states, 2 x V x M messages); the step's all-reduces over pp (``pp``
  all_reduce: the gradient norm's squares summed over the stages, a MoE's aux-loss routing counts,
  a tied weight's gradient shard summed between the first and last stage, :func:`tied_sync`); a
  MoE whose aux loss hf_tp computes over the step adds the routing pass (a no-grad forward: a third
  of the matmul and attention work; its collectives are not counted). Parameters and MFU's model
  FLOPs are the whole model's.

Pipeline stages in the estimate: how ``hf-tp train --pp`` cuts a model, which rank is the busiest,
the config of that rank's layers, and how many micro-batches' activations a rank holds at once.

The cut is training's own (:func:`hf_tp.pipeline.pipeline_split.balanced_cuts` over each decoder
layer's parameter count, read from a model built on the meta device: no memory), refused where
training refuses it (:func:`hf_tp.pipeline.pipeline_split.check_splittable`: multimodal wrappers,
forwards that change the hidden states outside the layers; :func:`hf_tp.core.dims.check_tied_schedule`:
a tied ``lm_head`` under a V-shaped schedule). A rank runs
stages ``rank + v * pp`` for v < ``pp_virtual_stages`` (``rank`` and ``2 pp - 1 - rank`` under a
V-shaped schedule, as training places them); the simulated rank is the one whose layers
hold the most parameters (ties: the later rank, which runs the last stage's ``lm_head``).

In-flight micro-batches (the activations saved for backward a rank holds at its peak), from torch's
schedules (``torch.distributed.pipelining.schedules``): under 1F1B rank ``r`` runs ``pp - r``
forwards before its first backward, so it holds ``min(pp - r, M)`` micro-batches (rank 0 the
most); GPipe runs every forward first: all ``M``; Interleaved 1F1B warms up with ``(V - 1) x
micro-batches per round + 2 (pp - 1 - r)`` forwards of one stage each, so rank 0 holds that plus
one stage-sized chunks (at most ``V x M``), i.e. that / V of its whole layers' micro-batches;
LoopedBFS runs every forward of every local stage first: ``M``. The last rank, which computes the
loss: 1F1B and Interleaved 1F1B hold one micro-batch of the last stage at a time (the last rank
runs no warm-up forwards of it), GPipe and LoopedBFS all ``M`` (:func:`last_in_flight`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter, wrapper
from hf_tp.adapters.census import unrouted_expert_params
from hf_tp.adapters.shrink import layer_kinds
from hf_tp.core.comm import RING_FACTOR, CommStat
from hf_tp.core.dims import V_SHAPED, check_tied_schedule
from hf_tp.core.module_queries import num_experts
from hf_tp.estimate.counters import Work
from hf_tp.estimate.estimate_run import Estimate, estimate_spec, model_label
from hf_tp.estimate.memory import MemoryBreakdown
from hf_tp.estimate.spec import BYTES, EstimateSpec, validate
from hf_tp.gpus import model_flops_per_token
from hf_tp.moe.aux_loss import standard_aux_loss
from hf_tp.moe.expert_parallel import experts_modules
from hf_tp.parallel.tp import embeddings_tied
from hf_tp.pipeline.pipeline_split import balanced_cuts, check_splittable, layer_costs

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

    def prefetch(self, config: PretrainedConfig, spec: EstimateSpec, model_name: str | None = None) -> None:
        """Queue the simulation layout ``spec`` of ``config`` will need, where ``simulate`` runs
        them in worker processes (:class:`hf_tp.estimate.depth.Simulator`)."""
        stage = simulated_stage(config, spec)
        if (config_key(stage.config), stage.spec) not in self.runs and hasattr(self.simulate, "prefetch"):
            self.simulate.prefetch(stage.config, stage.spec, model_name)


def estimate_layout(
    config: PretrainedConfig,
    spec: EstimateSpec,
    model_name: str | None = None,
    simulate: Simulate | None = None,
) -> Estimate:
    """One rank's memory, collectives and work for one step of ``spec`` (pp and HSDP included):
    the simulated stage (``simulate``: :func:`hf_tp.estimate.estimate_run.estimate_spec`, or a
    :class:`SimulationCache`) with the arithmetic of the module docstring."""
    validate(config, spec)
    simulate = simulate or estimate_spec
    stage = simulated_stage(config, spec)
    est = simulate(stage.config, stage.spec, model_label(config, model_name))
    if stage.replicas > 1:
        est = replicated(est, stage.replicas)
    if stage.plan is not None:
        est = staged(est, spec, stage.plan, list(stage.layers), config)
    return est


@dataclass(frozen=True)
class Stage:
    """What :func:`estimate_layout` simulates for a layout: ``config`` (the busiest rank's layers
    under pp) as ``spec`` (one micro-batch, the FSDP2 shard group's ranks), and what it derives the
    layout from: the pp ``plan`` and the rank's ``layers``, HSDP's ``replicas``."""

    config: PretrainedConfig
    spec: EstimateSpec
    plan: StagePlan | None = None
    layers: tuple[int, ...] = ()
    replicas: int = 1


def simulated_stage(config: PretrainedConfig, spec: EstimateSpec) -> Stage:
    """The :class:`Stage` simulated for layout ``spec`` (the layout itself without pp or derived HSDP)."""
    # HSDP from its shard group's simulation; a shard group of 1 (replicas only) has no reduce-scatter
    # to derive the all-reduce from, and is simulated as HSDP itself
    derive = 1 < spec.dp_replicate < spec.dp
    if spec.pp == 1 and not derive:
        return Stage(config, spec)
    plan = stage_plan(config, spec.pp * spec.pp_virtual_stages) if spec.pp > 1 else None
    if plan is not None:
        check_tied_schedule(plan.tied, spec.pp_schedule)
    layers = plan.rank_layers(spec.pp, plan.busiest_rank(spec.pp, spec.pp_schedule), spec.pp_schedule) if plan else []
    replicas = spec.dp_replicate if derive else 1
    # a stage of dense layers only (a model's first dense layers) runs without ep, as training's
    ep = spec.ep if plan is None or any(plan.expert_costs[i] for i in layers) else 1
    shard = spec.replace(
        dp=spec.dp // replicas, dp_replicate=spec.dp_replicate // replicas, batch_size=spec.batch_size // spec.microbatches,
        pp=1, pp_schedule="1f1b", pp_virtual_stages=1, microbatches=1, ep=ep,
    )  # fmt: skip
    return Stage(stage_config(config, plan, layers) if plan else config, shard, plan, tuple(layers), replicas)


def _stat(dim: str, collective: str, group: int, count: int, nbytes: int) -> CommStat:
    return CommStat(dim, collective, group, count, nbytes, int(nbytes * RING_FACTOR[collective](group)))


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


def staged(est: Estimate, spec: EstimateSpec, plan: StagePlan, layers: list[int], config: PretrainedConfig) -> Estimate:
    """``est`` (one micro-batch of the busiest rank's ``layers``) as that rank's whole pipeline step."""
    m, v = spec.microbatches, spec.pp_virtual_stages
    held = in_flight(spec.pp_schedule, spec.pp, m, v)
    rows = spec.batch_size // m
    world = spec.world_size
    comms = [
        _stat("world", c.collective, world, c.count, c.bytes) if c.dim == "world" else _per_step(c, spec)
        for c in est.comms
    ]
    message = rows * spec.seq_len * config.hidden_size * BYTES[spec.dtype] // (spec.tp * spec.cp)
    count = 2 * v * m
    comms.append(CommStat("pp", "send_recv", spec.pp, count, count * message, count * message))
    comms.append(_stage_all_reduces(spec, plan, config))
    routing = plan.aux_loss
    return dataclasses.replace(
        est,
        peak=_stage_peak(est, spec, config, held, sum(plan.expert_costs[i] for i in layers)),
        comms=comms,
        work=_per_step_work(est.work, m, routing),
        num_params=plan.num_params,
        model_flops_per_token=model_flops_per_token(config, plan.num_params, spec.seq_len, plan.unrouted_params),
        batch_size=spec.batch_size,
        pp=spec.pp,
        pp_schedule=spec.pp_schedule,
        pp_virtual_stages=v,
        microbatches=m,
        stage_layers=len(layers),
        ep=spec.ep,
        in_flight=held,
        routing_pass=routing,
        trainable_params=est.trainable_params * plan.num_params // max(est.num_params, 1),
    )


# FSDP2's collectives in a simulated stage: over its dp (x cp) ranks, a MoE's experts over the dp ranks
# outside their ep group (dp_out, units inside the stage's root: reduced with it), HSDP's replicas
FSDP2_COLLECTIVES = (
    ("dp", "reduce_scatter"), ("dp", "all_gather"), ("dp_out", "reduce_scatter"), ("dp_out", "all_gather"),
    ("dp_replicate", "all_reduce"),
)  # fmt: skip


def tied_sync(spec: EstimateSpec, plan: StagePlan) -> list[CommStat]:
    """A tied ``lm_head``'s gradient summed over the first and last stage's ranks, once per step
    (:meth:`hf_tp.pipeline.schedules.Pipeline.sync_tied_grads`: an all-reduce of this rank's fp32
    shard of the weight, over tp and FSDP2's dp x cp shard group); none when it is frozen (LoRA)."""
    if not plan.tied or spec.lora_r:
        return []
    vocab, hidden = plan.embedding_shape
    shard = spec.dp // spec.dp_replicate * spec.cp
    per_tp = -(-vocab // spec.tp)
    return [_stat("pp", "all_reduce", 2, 1, -(-per_tp // shard) * hidden * 4)]


def _stage_all_reduces(spec: EstimateSpec, plan: StagePlan, config: PretrainedConfig) -> CommStat:
    """The step's all-reduces over the pp ranks, as one stat: the gradient norm's squares summed over
    the stages (one fp64 scalar, :func:`hf_tp.parallel.grad.clip_grad_norm`), a MoE's routing counts
    for its aux loss (:func:`hf_tp.moe.pipeline_aux.route`: experts + 1 floats) and a tied
    weight's gradient (:func:`tied_sync`: between the first and last stage only)."""
    parts = [_stat("pp", "all_reduce", spec.pp, 1, 8)]
    if plan.aux_loss:
        parts.append(_stat("pp", "all_reduce", spec.pp, 1, (num_experts(config) + 1) * 4))
    parts += tied_sync(spec, plan)
    return CommStat(
        "pp", "all_reduce", spec.pp, len(parts), sum(c.bytes for c in parts), sum(c.sent_bytes for c in parts)
    )


def _per_step(c: CommStat, spec: EstimateSpec) -> CommStat:
    """One micro-batch's collective ``c`` over a pipeline step: FSDP2's reduce-scatter (and HSDP's
    all-reduce of it) once, at the step's end (:mod:`hf_tp.pipeline.pipeline_fsdp`); its all-gathers
    once per micro-batch's forward and backward, plus the schedule's shape pass (one micro-batch
    more), or once per step where a V-shaped schedule keeps the gathered weights; the rest (tp's,
    cp's, ep's all-to-alls) once per micro-batch and once more for the shape pass (its backward
    computes the stage's input gradients only: none on the first stage, a bound there)."""
    fsdp2 = (c.dim, c.collective) in FSDP2_COLLECTIVES
    if not fsdp2:
        times = spec.microbatches + 1
    elif c.collective == "all_gather":
        times = 1 if spec.pp_schedule in V_SHAPED else spec.microbatches + 1
    else:
        times = 1
    return CommStat(c.dim, c.collective, c.group_size, c.count * times, c.bytes * times, c.sent_bytes * times)


def _stage_peak(
    est: Estimate, spec: EstimateSpec, config: PretrainedConfig, held: float, experts: int
) -> MemoryBreakdown:
    """The busiest rank's peak over a step (the module docstring): the larger of the first rank's
    in-flight micro-batches before its first backward, the last rank's with their logits, and either
    rank once its first backward has run, when it holds the stage's unsharded gradients (in fp32:
    FSDP2 accumulates them in its reduce dtype, hf_tp's fp32) to the step's end with the micro-batches
    still in flight then; a V-shaped schedule also holds the stage's gathered weights through the
    step (of a MoE's ``experts`` routed expert weights, 1/ep on a rank, gradients and weights alike)."""
    m, v, act = spec.microbatches, spec.pp_virtual_stages, est.peak.activations
    logits = spec.batch_size // m * spec.seq_len * config.vocab_size // (spec.tp * spec.cp)  # its cp tokens
    last, copies = last_in_flight(spec.pp_schedule, spec.pp, m, v)
    at_last = (last - 1) * act + logits * (copies * HELD_LOGIT_BYTES + BACKWARD_LOGIT_BYTES)
    before = dataclasses.replace(est.peak, activations=act + int(max((held - 1) * act, at_last)))
    after = max(1.0, min(held, (m * v - 1) / v))  # in flight at a later backward (with the one it runs)
    others = experts - experts // spec.ep  # other ep ranks' experts
    grads = (est.trainable_params - (0 if spec.lora_r else others)) // spec.tp * 4  # LoRA: frozen experts
    weights = (est.num_params - others) // spec.tp * BYTES[spec.dtype] if spec.pp_schedule in V_SHAPED else 0
    during = dataclasses.replace(
        est.peak,
        activations=act + int((after - 1) * act),
        gradients=max(est.peak.gradients, grads),
        other=est.peak.other + weights,
    )
    return max(before, during, key=lambda peak: peak.total)


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


# Per-layer fields whose values are layer numbers (the layers that keep a dense MLP)
_LAYER_INDEX_LISTS = ("mlp_only_layers",)
_DENSE_PREFIX = ("first_k_dense_replace",)  # the first k layers are dense


@dataclass(frozen=True)
class StagePlan:
    """The whole model's figures and its cut into ``len(cuts)`` stages."""

    cuts: tuple[range, ...]
    costs: tuple[float, ...]  # each decoder layer's parameter count
    kinds: tuple[str, ...]  # each decoder layer's kind (hf_tp.adapters.shrink.layer_kinds)
    num_params: int
    unrouted_params: int  # routed experts' weights one token does not use (MFU's N leaves them out)
    aux_loss: bool  # a MoE whose aux loss needs a routing pass before a pipeline step
    expert_costs: tuple[int, ...] = ()  # each decoder layer's routed experts' parameters (0: a dense layer)
    tied: bool = False  # lm_head tied to the embedding: the first and the last stage each hold it
    embedding_shape: tuple[int, int] = (0, 0)  # (vocab, hidden) of the input embedding

    def rank_layers(self, pp: int, rank: int, schedule: str = "1f1b") -> list[int]:
        """The decoder layers of every stage ``rank`` runs: stages ``rank + v * pp``, or under a
        V-shaped schedule ``rank`` and ``2 pp - 1 - rank``."""
        if schedule in V_SHAPED:
            return [*self.cuts[rank], *self.cuts[len(self.cuts) - 1 - rank]]
        return [i for s in range(rank, len(self.cuts), pp) for i in self.cuts[s]]

    def busiest_rank(self, pp: int, schedule: str = "1f1b") -> int:
        """The rank whose layers hold the most parameters (ties: the later rank)."""
        load = [sum(self.costs[i] for i in self.rank_layers(pp, r, schedule)) for r in range(pp)]
        return max(range(pp), key=lambda r: (load[r], r))


_PLANS: dict[tuple[str, int], StagePlan] = {}


def config_key(config: PretrainedConfig) -> str:
    """A config's identity for caching (its fields as sorted JSON)."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def stage_plan(config: PretrainedConfig, stages: int) -> StagePlan:
    """``config`` cut into ``stages`` stages as ``hf-tp train --pp`` cuts it (cached per config)."""
    key = (config_key(config), stages)
    if key not in _PLANS:
        if wrapper.text_config_of(config) is not None:
            raise ValueError(f"pp: multimodal wrappers ({config.model_type}) are not cut into stages yet: use pp 1")
        adapter = get_adapter(config)
        with torch.device("meta"):
            model = wrapper.model_from_config(config)
        check_splittable(model, adapter)
        costs = layer_costs(model, adapter.layers_path)
        experts = [0] * len(costs)
        for path, module in experts_modules(model, adapter.layers_path, adapter.experts if adapter.moe else ()):
            experts[int(path[len(adapter.layers_path) + 1 :].split(".")[0])] += sum(
                p.numel() for p in module.parameters()
            )
        _PLANS[key] = StagePlan(
            cuts=tuple(balanced_cuts(costs, stages)),
            costs=tuple(costs),
            kinds=tuple(layer_kinds(config)),
            num_params=sum(p.numel() for p in model.parameters()),
            unrouted_params=unrouted_expert_params(model, config),
            aux_loss=standard_aux_loss(model),
            expert_costs=tuple(experts),
            tied=embeddings_tied(model),
            embedding_shape=tuple(model.get_input_embeddings().weight.shape),
        )
    return _PLANS[key]


def stage_config(config: PretrainedConfig, plan: StagePlan, layers: list[int]) -> PretrainedConfig:
    """``config`` with only decoder ``layers`` (with the embedding, final norm and lm_head): its
    per-layer lists picked, layer-number fields renumbered; a ``ValueError`` if the cut model's
    layers are not built as the originals are."""
    data = config.to_dict()
    total = config.num_hidden_layers
    out: dict = {"num_hidden_layers": len(layers)}
    for key, value in data.items():
        if isinstance(value, list) and len(value) == total and key not in ("architectures", *_LAYER_INDEX_LISTS):
            out[key] = [value[i] for i in layers]
    for key in _LAYER_INDEX_LISTS:
        if isinstance(data.get(key), list):
            out[key] = [j for j, i in enumerate(layers) if i in set(data[key])]
    for key in _DENSE_PREFIX:
        if isinstance(data.get(key), int):
            out[key] = sum(1 for i in layers if i < data[key])
    cut = config.__class__.from_dict({**data, **out})
    if layer_kinds(cut) != [plan.kinds[i] for i in layers]:
        raise ValueError(
            f"pp: cannot size a stage of this {config.model_type} model (layers {layers[0]}-{layers[-1]}): its "
            "config does not rebuild those layers alike on their own; estimate it at pp 1"
        )
    return cut


def in_flight(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Micro-batches (of a rank's whole layers) whose activations the busiest rank holds at once
    (rank 0; see the module docstring)."""
    m = microbatches
    if schedule == "1f1b":
        return float(min(pp, m))
    if schedule == "interleaved1f1b":
        per_round = m // max(1, m // pp)
        warmup = min((virtual - 1) * per_round + 2 * (pp - 1), m * virtual)
        return min(warmup + 1, m * virtual) / virtual
    return float(m)  # gpipe, loopedbfs: every forward before any backward


def last_in_flight(schedule: str, pp: int, microbatches: int, virtual: int) -> tuple[float, int]:
    """(micro-batches of its whole layers, micro-batches of the last stage) the last rank holds at once."""
    m = microbatches
    if schedule in ("gpipe", "loopedbfs"):
        return float(m), m
    if schedule == "interleaved1f1b":
        per_round = m // max(1, m // pp)
        return min((virtual - 1) * per_round + 1, m * virtual) / virtual, 1
    return 1.0, 1


def bubble_fraction(pp: int, microbatches: int, virtual: int) -> float:
    """The share of a step a pipeline rank waits idle: ``(pp - 1) / (V x M + pp - 1)``."""
    return (pp - 1) / (virtual * microbatches + pp - 1)
