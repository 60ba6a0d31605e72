"""Per-rank memory and communication of one training step, simulated in one CPU process.

The real program runs (the model built from its config, ``hf_tp.parallelize`` with FSDP2, one
loss_parallel forward/backward, clipping and an AdamW step) on fake tensors and a fake process
group of tp*dp ranks as rank 0. No weights are allocated and nothing is communicated; torch's
``MemTracker`` records every tensor the rank would hold, and a dispatch mode counts collectives.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter
from hf_tp.adapters.modules import num_experts
from hf_tp.adapters.quantized import full_precision
from hf_tp.compat import UnsupportedRelease, moe_estimate_refusal
from hf_tp.estimate.bounds import DataDependentBounds
from hf_tp.estimate.comm import CommCounter, CommStat
from hf_tp.estimate.groups import expert_groups, functional_groups, mesh_and_groups
from hf_tp.estimate.images import ImageLoad
from hf_tp.estimate.memory import GiB, MemoryBreakdown, MiB, PeakMemTracker
from hf_tp.estimate.moe import MoEStats, RoutedRows, find_experts, moe_stats
from hf_tp.estimate.simulate import simulation
from hf_tp.estimate.step import (
    DTYPES,
    build_optimizer,
    init_optimizer_state,
    make_batch,
    model_from_config,
    text_vocab_size,
    train_step,
)
from hf_tp.estimate.work import Work, WorkCounter
from hf_tp.parallel.mesh import check_dp_replicate
from hf_tp.parallel.passengers import in_tower, passenger_parameters
from hf_tp.train.config import TrainConfig
from hf_tp.train.validate import check_mixed_precision, validate_model_config

__all__ = ["Estimate", "GiB", "MemoryBreakdown", "MiB", "MoEStats", "estimate", "validate_inputs"]


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
    # image + text rows of a wrapper: what their images add, counted from the config (hf_tp.estimate.images)
    images: ImageLoad | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp

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


def validate_inputs(
    config: PretrainedConfig,
    tp: int,
    dp: int,
    seq_len: int,
    batch_size: int,
    dtype: str,
    ep: int = 1,
    cp: int = 1,
    dp_replicate: int = 1,
) -> None:
    """One-line ``ValueError``s for sizes that cannot be trained, before anything is built. A
    quantized checkpoint's config is sized as its dequantized copy (what hf_tp trains)."""
    config = full_precision(config)
    for name, value in (
        ("tp", tp),
        ("dp", dp),
        ("ep", ep),
        ("cp", cp),
        ("dp_replicate", dp_replicate),
        ("seq_len", seq_len),
        ("batch_size", batch_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got dtype={dtype!r}")
    validate_model_config(config, tp, seq_len, seq_len_name="seq_len", ep=ep, ep_name="ep")
    check_mixed_precision(config, dtype)
    check_dp_replicate(dp, dp_replicate, cp, ep)
    if num_experts(config) and (refusal := moe_estimate_refusal(dtype)):
        raise UnsupportedRelease(refusal)
    if (dp * cp) % ep:
        what = "dp x cp" if cp > 1 else "dp"
        raise ValueError(
            f"ep must divide {what} ({dp * cp}): expert parallelism borrows its ranks from {what}, got ep={ep}"
        )
    if cp > 1 and seq_len % (2 * cp * tp):
        raise ValueError(
            f"seq_len ({seq_len}) must be a multiple of 2*cp*tp ({2 * cp * tp}): each cp rank keeps two equal "
            "chunks of a row, each split over tp"
        )


def estimate(
    config: PretrainedConfig,
    tp: int,
    dp: int,
    seq_len: int,
    batch_size: int,
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
    model_name: str | None = None,
    ep: int = 1,
    lora_r: int = 0,
    lora_target_modules: str = "all-linear",
    cp: int = 1,
    dp_replicate: int = 1,
) -> Estimate:
    """Simulate one training step of ``config`` at (tp, dp) and return one rank's memory and comms.

    ``batch_size`` is sequences per dp rank. ``ep`` > 1 (mixture-of-experts models) splits each
    MoE layer's experts over ep of the dp (x cp) ranks, all-to-alls simulated with balanced routing
    (:func:`hf_tp.parallel.expert_parallel.balanced_routing`); ``cp`` > 1 splits each row's tokens
    over cp ranks; ``dp_replicate`` > 1 is HSDP: the state sharded over the dp / dp_replicate ranks of a
    replica, gradients all-reduced across replicas. ``lora_r`` > 0 sizes ``hf-tp train --lora-r``'s run
    (``lora_target_modules``: ``all-linear`` or comma-separated names): the frozen base in the compute dtype,
    fp32 adapters with gradients and AdamW state. One CPU core, ~0.3 s per decoder layer; no GPU or network. A
    multimodal wrapper is built and parallelized as ``hf-tp train`` does it (tower and projector whole over tp,
    FSDP2 over dp, the tower frozen); its step is text-only (no image activations).
    """
    validate_inputs(config, tp, dp, seq_len, batch_size, dtype, ep, cp, dp_replicate)
    config = _checked_for_training(config, lora_r, lora_target_modules)
    start = time.perf_counter()
    with simulation(tp * cp * dp):
        mesh, groups = mesh_and_groups(tp, cp, dp, dp_replicate)
        fake = FakeTensorMode()
        with fake:
            model = model_from_config(config, mesh, dtype, activation_checkpointing, ep, lora_r, lora_target_modules)
            optimizer = build_optimizer(model)
            init_optimizer_state(model, optimizer)
            batch = make_batch(text_vocab_size(config), batch_size, seq_len)
        num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tower, projector = _passenger_params(model, config)
        experts = find_experts(model, config)
        counter = CommCounter(groups, expert_groups(experts, groups), functional_groups(mesh, cp))
        peak, state, moe, work = _tracked_step(fake, model, optimizer, batch, dp, config, experts, counter)
    return Estimate(
        model=model_name or getattr(config, "name_or_path", "") or config.model_type,
        model_type=config.model_type,
        num_params=num_params,
        tp=tp,
        dp=dp,
        ep=ep,
        seq_len=seq_len,
        batch_size=batch_size,
        dtype=dtype,
        activation_checkpointing=activation_checkpointing,
        peak=peak,
        state=state,
        comms=counter.stats(),
        moe=moe,
        seconds=time.perf_counter() - start,
        work=work,
        lora_r=lora_r,
        lora_target_modules=lora_target_modules if lora_r else "",
        trainable_params=trainable,
        cp=cp,
        dp_replicate=dp_replicate,
        tower_params=tower,
        projector_params=projector,
    )


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
    fake: FakeTensorMode,
    model,
    optimizer,
    batch: dict,
    dp: int,
    config: PretrainedConfig,
    experts,
    counter: CommCounter,
) -> tuple[MemoryBreakdown, MemoryBreakdown, MoEStats | None, Work]:
    """Run the training step under the memory tracker, ``counter`` and a work counter: the peak,
    the state right after the optimizer step, the MoE figures (None for a dense model), the work."""
    tracker = PeakMemTracker()
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
