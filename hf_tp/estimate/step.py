"""One training step as ``hf-tp train`` runs it, shared by the estimate (fake tensors) and the
real-memory measurement (:func:`measure`, real tensors), so the two measure the same program.

:func:`measure` runs the step on real tensors in an initialised process group (gloo, or NCCL on
GPUs), with torch's ``MemTracker`` in eager mode and, for reference, the process's peak resident
set size (Linux ``/proc``), which also counts allocator and library overhead.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter, wrapper
from hf_tp.estimate.memory import MemoryBreakdown, PeakMemTracker
from hf_tp.estimate.spec import EstimateSpec
from hf_tp.parallel import parallelize
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.parallel.linear_ce import fusable
from hf_tp.parallel.lora import freeze_in_dtype
from hf_tp.train import loss as train_loss
from hf_tp.train import model as train_model
from hf_tp.train import optim as train_optim
from hf_tp.train.config import TrainConfig


def model_from_config(config: PretrainedConfig, mesh: DeviceMesh, spec: EstimateSpec) -> nn.Module:
    """fp32 master weights from ``config``, parallelized over ``mesh`` like the loop does (``spec.ep``
    ranks of dp splitting the experts, ``spec.activation_checkpointing``).

    bf16 is FSDP2's mixed precision (bf16 compute, fp32 master weights and gradient reductions).
    ``spec.lora_r`` > 0: peft LoRA adapters on ``spec.lora_target_modules`` as ``hf-tp train --lora-r`` wraps
    them, the frozen base stored in the compute dtype, the adapters in fp32. A multimodal wrapper
    is built as its ``*ForConditionalGeneration`` class, as ``hf-tp train`` builds it: parallelize
    replicates its vision tower and projector over tp, shards them over dp and freezes the tower.
    """
    # (a copy: parallelize may change the config, e.g. the attention implementation under cp)
    with mock.patch.object(nn.Module, "to", _fp32_to):
        model = wrapper.model_from_config(copy.deepcopy(config), dtype=torch.float32)
    model.train()
    if wrapper.text_config_of(config) is not None:
        # its adapter builds it on the meta device once (cached per config): not under fake tensors
        with unset_fake_temporarily():
            get_adapter(model.config)
    compute = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
    if spec.lora_r:
        # peft moves each new module to its base layer's device and dtype, here already theirs (one
        # device, fp32): a no-op, except that Module.to() cannot swap fake tensors, so it is skipped
        with mock.patch.object(nn.Module, "to", lambda module, *args, **kwargs: module):
            lora = TrainConfig(lora_r=spec.lora_r, lora_target_modules=spec.lora_target_modules)
            peft_model = train_model.with_lora(model, lora)
        freeze_in_dtype(model, compute)
    mp = train_model.mixed_precision(compute)
    ac = spec.activation_checkpointing
    parallelize(peft_model if spec.lora_r else model, mesh, mp_policy=mp, activation_checkpointing=ac, ep=spec.ep)
    return model  # (a LoRA model in place: the loop too steps the HF model inside the peft model)


_MODULE_TO = nn.Module.to


def _fp32_to(module: nn.Module, *args, **kwargs) -> nn.Module:
    """``Module.to`` while the fp32 model is built: a model's own cast of a module to fp32 in its
    ``__init__`` (Inkling's short convolutions, DeepSeek-V4's attention and hyper-connections) is a
    no-op on its fp32 weights, but ``Module.to`` cannot swap fake tensors; any other conversion goes
    through."""
    only = args[0] if len(args) == 1 and not kwargs else kwargs.get("dtype") if set(kwargs) == {"dtype"} else None
    if only is torch.float32 and all(p.dtype == torch.float32 for p in module.parameters()):
        return module
    return _MODULE_TO(module, *args, **kwargs)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The loop's AdamW as it runs on GPUs (fused: one kernel, no temporaries of the parameters'
    size; a foreach step would hold several), over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return train_optim.build_optimizer(params, lr=1e-4, weight_decay=0.0, device=torch.device("cuda"))


def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state with one step on zero gradients (cheaper than a warm-up forward)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def text_vocab_size(config: PretrainedConfig) -> int:
    """The vocabulary the batch's token ids come from: a multimodal wrapper's language model's."""
    return (wrapper.text_config_of(config) or config).vocab_size


def make_batch(vocab_size: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A packed batch as the collator gives it: input_ids, an all-ones attention mask, labels."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    dp: int,
    max_grad_norm: float = 1.0,
    after_optimizer_step: Callable[[], None] | None = None,
) -> None:
    """Forward + backward under loss_parallel, the SP norm-gradient reduction, exact grad clipping,
    AdamW step, zero_grad.

    The loss is a token mean over the global batch (``num_items_in_batch``) scaled by dp for
    FSDP2's averaging, as in ``hf_tp.train.loop``. Clipping multiplies by a tensor coefficient
    instead of reading the norm back to Python, so it also runs on fake tensors.
    """
    b, s = batch["input_ids"].shape
    with train_loss.loss_context(True):  # model_from_config parallelizes with loss_parallel=True
        fused = fusable(model)
        loss, _ = train_loss.training_loss(model, batch, dp * b * (s - 1), fused)
        (loss * dp).backward()
    norm = clip_grad_norm(model.parameters(), 0.0)  # measure only: the norm's collectives
    coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    optimizer.step()
    if after_optimizer_step is not None:
        after_optimizer_step()
    optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Measurement:
    """One rank's tracked memory for a real step, plus resident-memory figures (None off Linux)."""

    peak: MemoryBreakdown
    state: MemoryBreakdown
    rss_peak_delta: int | None  # peak RSS during the tracked steps, minus RSS before the model was built
    seconds: float
    cuda_peak: int | None = None  # torch.cuda.max_memory_allocated over the tracked steps (GPU runs)


def _status_kib(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", status.read_text(), re.MULTILINE)
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(config: PretrainedConfig, mesh: DeviceMesh, *shape, steps: int = 1, seed: int = 0, **named) -> Measurement:
    """:func:`measure_spec` of the :class:`EstimateSpec` of ``mesh``'s (tp, dp) and ``shape``/``named``
    (``seq_len, batch_size, dtype, activation_checkpointing``, then ``ep``, ``lora_r``, ...)."""
    return measure_spec(config, mesh, EstimateSpec(mesh["tp"].size(), mesh["dp"].size(), *shape, **named), steps, seed)


def measure_spec(
    config: PretrainedConfig, mesh: DeviceMesh, spec: EstimateSpec, steps: int = 1, seed: int = 0
) -> Measurement:
    """Build the model on real tensors on the mesh's device (CPU, or this rank's GPU), run ``steps``
    tracked training steps, report this rank.

    ``mesh`` is the ("dp", "tp") mesh of an initialised process group, laid out as ``spec`` (``ep`` of
    its dp ranks splitting the experts; ``lora_r`` > 0: a LoRA run as the estimate sizes it). The optimizer state is
    created before tracking starts, as in the estimate. On a GPU the caching allocator's own peak
    (``torch.cuda.max_memory_allocated``, reset after the optimizer state exists) is reported too.
    """
    start = time.perf_counter()
    torch.manual_seed(seed)
    cuda = mesh.device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rss_before = _status_kib("VmRSS")
    with device:  # factory functions (the model's weights, the batch) allocate on the mesh's device
        model = model_from_config(config, mesh, spec)
        optimizer = build_optimizer(model)
        init_optimizer_state(model, optimizer)
        batch = make_batch(text_vocab_size(config), spec.batch_size, spec.seq_len)
    can_reset = _reset_peak_rss()  # the steps' peak, not the model build's temporary copies
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = PeakMemTracker()
    tracker.track_external(model, optimizer)
    after: list[dict] = []
    with tracker:
        for _ in range(steps):
            tracker.reset_mod_stats()  # MemTracker refuses a second forward of the same modules otherwise
            after_step = lambda: after.append(tracker.get_tracker_snapshot("current"))  # noqa: E731
            train_step(model, optimizer, batch, mesh["dp"].size(), after_optimizer_step=after_step)
    rss_peak = _status_kib("VmHWM")
    cuda_peak = torch.cuda.max_memory_allocated() if cuda else None
    rss_delta = None
    if can_reset and rss_before is not None and rss_peak is not None:
        rss_delta = (rss_peak - rss_before) * 1024
    return Measurement(
        peak=MemoryBreakdown.from_snapshot(tracker.get_tracker_snapshot("peak")),
        state=MemoryBreakdown.from_snapshot(after[-1]),
        rss_peak_delta=rss_delta,
        seconds=time.perf_counter() - start,
        cuda_peak=cuda_peak,
    )
