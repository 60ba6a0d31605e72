"""Per-rank memory and communication of one training step, simulated in one CPU process.

The real program runs (the model built from its config, ``hf_tp.parallelize`` with FSDP2, one
loss_parallel forward/backward, clipping and an AdamW step) on fake tensors and a fake process
group of tp*cp*dp ranks as rank 0. No weights are allocated and nothing is communicated; torch's
``MemTracker`` records every tensor the rank would hold, and a dispatch mode counts collectives.

What DPO's reference model adds to a step (:func:`reference_cost`, ``hf-tp estimate --objective dpo``):
``hf-tp train --objective dpo`` without ``--lora-r`` builds the reference as a frozen copy of the
checkpoint, sharded exactly like the policy (the same plan on the same mesh, FSDP2 over dp, fp32
shards) but without gradients or optimizer state, and runs it once per micro-batch, without
autograd, after the policy's forward (whose saved activations are then alive). So it adds:

- its weights: the policy's parameter shards once more, held for the whole run;
- its forward: simulated here as the rest of the estimate is (fake tensors, a fake process
  group, the real parallelized model and log-prob code), no-grad: one decoder layer gathered and
  computed at a time. The step's peak is then the larger of the policy's own peak and the moment
  of the reference forward (the policy's state and saved activations, plus that forward's peak);
- compute: one more forward, about a third of a training step (2N of 6N FLOPs per token).

With ``--lora-r`` the reference is the policy with its adapters off (no second copy: no memory,
the forward's time only); ``--precompute-ref`` scores the pairs once before training (the copy
is freed after it: no memory and no time per step); SimPO has no reference.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.adapters.census import unrouted_expert_params
from hf_tp.adapters.quantized import full_precision
from hf_tp.compat.torch_fake import fake_tensor_mode
from hf_tp.core.model_source import ModelSource
from hf_tp.estimate.counters import CommCounter, CommStat, Work, WorkCounter
from hf_tp.estimate.memory import (
    MemoryBreakdown,
    MoEStats,
    PeakMemTracker,
    RoutedRows,
    SegmentKey,
    SegmentTracker,
    decoder_layers,
    find_experts,
    moe_stats,
)
from hf_tp.estimate.simulate import (
    DataDependentBounds,
    build_optimizer,
    expert_groups,
    functional_groups,
    init_optimizer_state,
    make_batch,
    mesh_and_groups,
    model_from_config,
    simulation,
    text_vocab_size,
    train_step,
)
from hf_tp.estimate.spec import EstimateSpec, GiB, ImageLoad, MiB, validate
from hf_tp.gpus import model_flops_per_token
from hf_tp.moe.routing import BALANCED, set_routing
from hf_tp.multimodal.passengers import in_tower, passenger_parameters
from hf_tp.parallel.logps import sequence_log_probs
from hf_tp.run.config import TrainConfig
from hf_tp.run.loss import loss_context

__all__ = ["Estimate", "EstimateSpec", "GiB", "MemoryBreakdown", "MiB", "MoEStats", "estimate", "estimate_spec"]


@dataclass(frozen=True)
class Estimate:
    """One rank's memory and communication for one (tp, dp) training step (ep of dp's ranks
    splitting the experts).

    ``peak`` is the breakdown at the moment of the step's peak (unsharded FSDP parameters count
    as parameters there); ``state`` is right after the optimizer step: the sharded parameters,
    gradients and optimizer state that a rank holds across steps (gradients are freed by
    ``zero_grad``). Neither includes the CUDA context or allocator fragmentation. ``moe`` is set
    for mixture-of-experts models; at ep > 1 its all-to-all figures assume balanced routing.
    """

    model: str
    model_type: str
    num_params: int
    tp: int
    dp: int
    ep: int
    seq_len: int
    batch_size: int
    dtype: str
    activation_checkpointing: bool
    peak: MemoryBreakdown
    state: MemoryBreakdown
    comms: list[CommStat] = field(default_factory=list)
    moe: MoEStats | None = None
    seconds: float = 0.0
    work: Work | None = None
    cp: int = 1  # context parallelism: each row's tokens over cp ranks (K/V all-gathered per layer)
    lora_r: int = 0  # > 0: a LoRA run (frozen base in the compute dtype, fp32 adapters and their state)
    lora_target_modules: str = ""
    trainable_params: int = 0
    # a multimodal wrapper: its vision (or audio) tower's parameters, frozen as hf-tp train's default
    # (no gradient, no optimizer state), and its projector's, trained; both replicated over tp and
    # FSDP2-sharded over dp. The step is text-only: neither runs (see :func:`estimate`)
    tower_params: int = 0
    projector_params: int = 0
    dp_replicate: int = 1  # HSDP: dp = dp_replicate replicas x an FSDP2 shard group of dp / dp_replicate
    # image + text rows of a wrapper: what their images add, counted from the config (hf_tp.estimate.spec)
    images: ImageLoad | None = None
    model_flops_per_token: float = 0.0  # hf_tp.gpus.model_flops_per_token: the numerator of MFU
    # the decoder-layer counts simulated when the estimate was extended from short runs to the model's
    # depth (hf_tp.estimate.depth); empty: every layer simulated
    extended_from: tuple[int, ...] = ()
    # pipeline parallelism (hf_tp.estimate.layouts): the busiest rank's stage(s) over a whole step
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int = 1
    stage_layers: int = 0  # decoder layers on the simulated rank (0: all, no pipeline)
    in_flight: float = 1.0  # micro-batches whose saved activations that rank holds at once
    routing_pass: bool = False  # a MoE's aux loss under pp: one no-grad forward first

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    @property
    def spec(self) -> EstimateSpec:
        """The layout and shape this estimate simulated (another batch or split: ``est.spec.replace(...)``)."""
        return EstimateSpec(
            self.tp, self.dp, self.seq_len, self.batch_size, self.dtype, self.activation_checkpointing, self.ep,
            self.lora_r, self.lora_target_modules or "all-linear", self.cp, self.dp_replicate, self.pp,
            self.pp_schedule, self.pp_virtual_stages, self.microbatches,
        )  # fmt: skip

    def sent_bytes(self, dim: str) -> int:
        """Bytes one rank sends per step over mesh dim ``dim`` (ring algorithms)."""
        return sum(c.sent_bytes for c in self.comms if c.dim == dim)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("peak", "state", "comms", "moe", "work")}
        out.update(
            world_size=self.world_size,
            peak=self.peak.to_dict(),
            state=self.state.to_dict(),
            comms=[c.to_dict() for c in self.comms],
            moe=None if self.moe is None else self.moe.to_dict(),
            work=None if self.work is None else self.work.to_dict(),
        )
        return out


def estimate(config: PretrainedConfig | str, *shape, model_name: str | None = None, **named) -> Estimate:
    """Simulate one training step of ``config`` and return one rank's memory and comms: the
    :class:`~hf_tp.estimate.spec.EstimateSpec` of ``shape`` and ``named`` (``tp, dp, seq_len,
    batch_size``, then ``dtype``, ``ep``, ``cp``, ``lora_r``, ...) through :func:`estimate_spec`."""
    return estimate_spec(config, EstimateSpec(*shape, **named), model_name)


def estimate_spec(config: PretrainedConfig | str, spec: EstimateSpec, model_name: str | None = None) -> Estimate:
    """Simulate one training step of ``config`` laid out and shaped as ``spec``. ``config`` may
    also be what ``hf-tp estimate --model`` takes (a bundled name, a local folder or config.json,
    a Hub id: :meth:`hf_tp.core.model_source.ModelSource.for_shapes`), then reported by that name.

    At ``spec.ep`` > 1 the all-to-alls are simulated with balanced routing
    (:data:`hf_tp.moe.routing.BALANCED`, installed on the experts: fake tensors have no routing).
    A LoRA run is sized as ``hf-tp train --lora-r`` runs it: the frozen base in the compute dtype,
    fp32 adapters with gradients and AdamW state. One CPU core, ~0.2 s per decoder layer; no GPU or
    network. A multimodal wrapper is built and parallelized as ``hf-tp train`` does it (tower and
    projector whole over tp, FSDP2 over dp, the tower frozen); its step is text-only (no image
    activations). (:func:`hf_tp.estimate.depth.estimate_fast`: the same from two short runs.)
    """
    if not isinstance(config, PretrainedConfig):
        source = ModelSource.for_shapes(config)
        config, model_name = source.config, model_name or source.name
    return simulate_spec(config, spec, model_name)[0]


def simulate_spec(
    config: PretrainedConfig, spec: EstimateSpec, model_name: str | None = None
) -> tuple[Estimate, dict[SegmentKey, MemoryBreakdown]]:
    """:func:`estimate_spec` and the step's memory by segment (:mod:`hf_tp.estimate.memory`)."""
    validate(config, spec)
    if spec.pp > 1:
        raise ValueError(
            "estimate_spec simulates one stage's layout: estimate pp > 1 with hf_tp.estimate.estimate_layout"
        )
    config = _checked_for_training(config, spec.lora_r, spec.lora_target_modules)
    start = time.perf_counter()
    with simulation(spec.world_size):
        mesh, groups = mesh_and_groups(spec.tp, spec.cp, spec.dp, spec.dp_replicate)
        fake = fake_tensor_mode()
        with fake:
            model = model_from_config(config, mesh, spec)
            optimizer = build_optimizer(model)
            init_optimizer_state(model, optimizer)
            batch = make_batch(text_vocab_size(config), spec.batch_size, spec.seq_len)
        num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
        experts = find_experts(model, config)
        set_routing(experts, BALANCED)
        counter = CommCounter(groups, expert_groups(experts, groups), functional_groups(mesh, spec.cp))
        tracker = SegmentTracker(decoder_layers(model, get_adapter(config).layers_path))
        peak, state, moe, work = _tracked_step(
            fake, model, optimizer, batch, spec.dp, config, experts, counter, tracker
        )
        tower, projector = _passenger_params(model, config)
        flops = model_flops_per_token(config, num_params, spec.seq_len, unrouted_expert_params(model, config))
    est = Estimate(
        model=model_label(config, model_name),
        model_type=config.model_type,
        num_params=num_params,
        tp=spec.tp,
        dp=spec.dp,
        ep=spec.ep,
        seq_len=spec.seq_len,
        batch_size=spec.batch_size,
        dtype=spec.dtype,
        activation_checkpointing=spec.activation_checkpointing,
        peak=peak,
        state=state,
        comms=counter.stats(),
        moe=moe,
        seconds=time.perf_counter() - start,
        work=work,
        lora_r=spec.lora_r,
        lora_target_modules=spec.lora_target_modules if spec.lora_r else "",
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        cp=spec.cp,
        dp_replicate=spec.dp_replicate,
        tower_params=tower,
        projector_params=projector,
        model_flops_per_token=flops,
    )
    return est, tracker.breakdowns()


def model_label(config: PretrainedConfig, model_name: str | None = None) -> str:
    """The model name an estimate reports: ``model_name``, else the config's path, else its type
    (a stage or a cut config's runs report the whole model's, passed down as ``model_name``)."""
    return model_name or getattr(config, "name_or_path", "") or config.model_type


def _checked_for_training(config: PretrainedConfig, lora_r: int, lora_target_modules: str) -> PretrainedConfig:
    """The checks ``hf-tp train`` makes of LoRA; returns the config in full precision (a quantized
    checkpoint: hf_tp trains its dequantized copy). (cp on a multimodal wrapper whose forward builds
    its own masks is refused by ``hf_tp.parallelize`` when the step is simulated.)"""
    if lora_r:
        TrainConfig(lora_r=lora_r, lora_target_modules=lora_target_modules).validate()
    return full_precision(config)


def _passenger_params(model, config: PretrainedConfig) -> tuple[int, int]:
    """A multimodal wrapper's (vision tower, projector) parameter counts; (0, 0) for a causal LM."""
    adapter = get_adapter(config)
    if not adapter.language_model:
        return 0, 0
    params = passenger_parameters(model, adapter)
    tower = sum(p.numel() for n, p in params if in_tower(adapter, n))
    return tower, sum(p.numel() for _, p in params) - tower


def _tracked_step(
    fake: contextlib.AbstractContextManager,
    model,
    optimizer,
    batch: dict,
    dp: int,
    config: PretrainedConfig,
    experts,
    counter: CommCounter,
    tracker: PeakMemTracker,
) -> tuple[MemoryBreakdown, MemoryBreakdown, MoEStats | None, Work]:
    """Run the training step under the memory ``tracker``, ``counter`` and a work counter: the peak,
    the state right after the optimizer step, the MoE figures (None for a dense model), the work."""
    tracker.track_external(model, optimizer)
    tracker.watch(experts)
    routed = RoutedRows(experts)
    work = WorkCounter()
    after: list[dict] = []
    with fake, DataDependentBounds(), tracker, counter, work:  # (bounds: innermost above the fake mode)
        after_step = lambda: after.append(tracker.get_tracker_snapshot("current"))  # noqa: E731
        train_step(model, optimizer, batch, dp, after_optimizer_step=after_step)
    routed.remove()
    peak = MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak"))
    moe = moe_stats(model, config, experts, tracker, routed) if experts else None
    return peak, MemoryBreakdown.from_snapshot(after[0]), moe, work.work


@dataclass(frozen=True)
class ReferenceCost:
    """Per rank: the reference's ``kind``, its ``weights`` (bytes held through the run), its
    no-grad forward's peak (``forward``, bytes beyond the weights), the step's ``peak`` and
    between-steps ``state`` totals with it, and its forward's compute as a fraction of a step."""

    objective: str
    kind: str  # "frozen copy", "adapters off", "precomputed", "none"
    weights: int = 0
    forward: int = 0
    peak: int = 0
    state: int = 0
    compute: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """What the report says of it."""
        head = f"{self.objective.upper()} reference: {self.kind}"
        if self.kind != "frozen copy":
            extra = {
                "adapters off": "the policy's own weights (no copy, no memory); one no-grad forward per micro-batch "
                "(+1/3 of a step's compute)",
                "precomputed": "scored once before training (the frozen copy freed after it): nothing per step",
                "none": "SimPO needs none",
            }[self.kind]
            return [f"{head}: {extra}"]
        return [
            f"{head}: weights {self.weights / MiB:,.1f} MiB per rank (sharded like the policy, no gradients or "
            f"optimizer state), its no-grad forward {self.forward / MiB:,.1f} MiB at its peak",
            f"  with it: peak {self.peak / MiB:,.1f} MiB, after step {self.state / MiB:,.1f} MiB per rank; "
            "+1/3 of a step's compute (one more forward)",
        ]


def reference_cost(est: Estimate, config: PretrainedConfig, objective: str, precompute: bool = False) -> ReferenceCost:
    """What ``objective``'s reference adds to ``est`` (a step on the pairs' 2 x pairs rows)."""
    if objective != "dpo":
        return ReferenceCost(objective, "none", peak=est.peak.total, state=est.state.total)
    if precompute:
        return ReferenceCost(objective, "precomputed", peak=est.peak.total, state=est.state.total)
    if est.lora_r:
        return ReferenceCost(objective, "adapters off", peak=est.peak.total, state=est.state.total, compute=1 / 3)
    weights = est.state.parameters  # the policy's parameter shards: the copy is built and sharded alike
    forward = _no_grad_forward_peak(est, config) - weights
    during = est.state.total + est.peak.activations + weights + forward
    peak = max(est.peak.total + weights, during)
    return ReferenceCost(objective, "frozen copy", weights, forward, peak, est.state.total + weights, 1 / 3)


def _no_grad_forward_peak(est: Estimate, config: PretrainedConfig) -> int:
    """Bytes one rank holds at the peak of the frozen copy's log-prob forward (its shards included)."""
    with simulation(est.world_size):
        mesh, _ = mesh_and_groups(est.tp, est.cp, est.dp, est.dp_replicate)
        fake = fake_tensor_mode()
        with fake:
            frozen = est.spec.replace(activation_checkpointing=False, lora_r=0)  # a no-grad copy of the base
            model = model_from_config(config, mesh, frozen).requires_grad_(False).eval()
            batch = make_batch(text_vocab_size(config), est.batch_size, est.seq_len)
        tracker = PeakMemTracker()
        tracker.track_external(model)
        with fake, tracker, torch.no_grad(), loss_context(True):
            sequence_log_probs(model, batch)
        return MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak")).total
