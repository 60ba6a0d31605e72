"""The step an estimate simulates: one rank of a large tp x dp job run in one CPU process on fake
tensors, and the training step it runs, as ``hf-tp train`` runs it.

The fake world: a fake process group, the mesh :func:`hf_tp.build_mesh` makes with its process
groups by name -> (mesh dim, size), which the comm counter files each collective under, and the
patches that let the real program run on fake tensors. Each is a context manager that undoes
itself, so an estimate leaves no global state behind and can run again in the same process.

The step: the model built from its config and parallelized as the loop does
(:func:`model_from_config`), its AdamW, one :func:`train_step`. The estimate runs it on fake tensors;
:func:`measure` runs the same program on real tensors in an initialised process group (gloo, or
NCCL on GPUs), with torch's ``MemTracker`` in eager mode and, for reference, the process's peak
resident set size (Linux ``/proc``), which also counts allocator and library overhead.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from hf_tp.adapters import get_adapter, wrapper
from hf_tp.compat.torch_distributed import flatten_mesh
from hf_tp.compat.torch_fake import (
    TorchDispatchMode,
    clear_sharding_prop_cache,
    fake_store,
    fake_trunc_normal,
    quiet_redistribute_warning,
    real_device_meshes,
    separate_sharding_fake_mode,
    unset_fake_temporarily,
)
from hf_tp.compat.transformers_private import fake_grouped_mm_any_dtype, unmasked_causal_attention
from hf_tp.core.mesh import HSDP_DIMS
from hf_tp.estimate.memory import MemoryBreakdown, PeakMemTracker, ep_groups
from hf_tp.estimate.spec import EstimateSpec
from hf_tp.lora.peft_models import freeze_in_dtype
from hf_tp.parallel import parallelize
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.parallel.linear_ce import fusable
from hf_tp.run import loss as train_loss
from hf_tp.run import model as train_model
from hf_tp.run import optim as train_optim
from hf_tp.run.config import TrainConfig


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks, this process as rank 0; destroyed on exit."""
    if dist.is_initialized():
        raise ValueError(
            "an estimate runs its own fake process group; call it outside an initialised process group "
            "(before dist.init_process_group or after dist.destroy_process_group)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)  # (registers "fake")
    _clear_sharding_caches()
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_caches()


def _clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions between fake worlds.

    DeviceMesh equality ignores process-group names, so an output spec cached in an earlier world
    can carry that world's mesh, whose group names belong to other groups in this one (a cp sweep
    then gathered tp activations over the old cp group). A no-op if torch moves the helper.
    """
    clear_sharding_prop_cache()


@contextlib.contextmanager
def simulation(world_size: int) -> Iterator[None]:
    """Everything an estimate needs around its fake-tensor run; all undone on exit."""
    with (
        fake_world(world_size),
        fake_grouped_mm_any_dtype(),
        real_device_meshes(),
        separate_sharding_fake_mode(),
        unmasked_causal_attention(),
        quiet_redistribute_warning(),
        fake_trunc_normal(),
    ):
        yield


def expert_groups(experts, groups: dict[str, tuple[str, int]]) -> dict[tuple[str, str], tuple[str, int]]:
    """Add the ep mesh's groups to ``groups`` (its tp dim is the tp ranks again) and return the
    all-to-alls to count as ep, named so even where the ep ranks are all the dp ranks (one group)."""
    all_to_all = {}
    for name, dim in ep_groups(experts).items():
        groups.setdefault(name, dim)
        if dim[0] == "ep":
            all_to_all[(name, "all_to_all")] = dim
    return all_to_all


def functional_groups(mesh: DeviceMesh, cp: int) -> dict[str, tuple[str, int]]:
    """The cp group for the comm counter's functional collectives: cp's K/V gathers are functional,
    FSDP2's over dp x cp are c10d ones, and at dp = 1 the two share one process group."""
    return {mesh["cp"].get_group().group_name: ("cp", cp)} if cp > 1 else {}


def mesh_and_groups(tp: int, cp: int, dp: int, dp_replicate: int) -> tuple[DeviceMesh, dict[str, tuple[str, int]]]:
    """:func:`_layout_mesh` and, as "world", the group of the gradient norm's one all-reduce over
    every rank (:func:`hf_tp.parallel.grad.clip_grad_norm`)."""
    mesh, groups = _layout_mesh(tp, cp, dp, dp_replicate)
    groups.setdefault(dist.group.WORLD.group_name, ("world", dist.get_world_size()))
    return mesh, groups


def _layout_mesh(tp: int, cp: int, dp: int, dp_replicate: int) -> tuple[DeviceMesh, dict[str, tuple[str, int]]]:
    """The mesh hf_tp.build_mesh makes, and its groups by name -> (dim, size) for the comm counter
    (sliced outside fake mode). With cp, FSDP2 runs on dp x cp: its traffic is counted as "dp".
    With HSDP, FSDP2's gathers and reduce-scatters over the shard group count as "dp", its
    gradient all-reduce across replicas as "dp_replicate", and collectives over all dp ranks
    (e.g. a router's gradient kept whole) as "dp_all"."""
    if dp_replicate > 1:
        mesh = init_device_mesh("cpu", (dp_replicate, dp // dp_replicate, tp), mesh_dim_names=HSDP_DIMS)
        flat = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        named = {"tp": "tp", "dp_shard": "dp", "dp_replicate": "dp_replicate"}
        groups = {mesh[d].get_group().group_name: (name, mesh[d].size()) for d, name in named.items()}
        groups.setdefault(flat.get_group().group_name, ("dp_all", flat.size()))
        return mesh, groups
    if cp == 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return mesh, {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in ("dp", "tp")}
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    flat = flatten_mesh(mesh["dp", "cp"], "dp_cp")
    groups = {mesh[d].get_group().group_name: (d, mesh[d].size()) for d in ("cp", "tp")}
    groups[flat.get_group().group_name] = ("dp", flat.size())
    return mesh, groups


# Ops whose output size depends on the data, under the estimate's fake tensors.
#
# A fake tensor has no values, so ``nonzero`` (Qwen4-Exp's sparse-attention indexer lists the keys a
# query may see with it) cannot know how many elements it returns; torch's fake mode refuses it.
# The estimate takes such an op at its upper bound, every element selected (for the indexer: every
# visible key), so the step runs with the largest tensors the op can produce: memory and work are
# never under-counted for it.
aten = torch.ops.aten


class DataDependentBounds(TorchDispatchMode):
    """Run (innermost, just above the fake mode) the ops whose output shape depends on values:
    ``nonzero`` as its upper bound (the indices of every element, an uninitialized ``[numel, dim]``
    long tensor), ``bincount`` with a ``minlength`` as ``minlength`` bins (the indices are categories
    below it: experts, ranks; e.g. transformers' load-balancing loss before 5.2x, on rows without
    a padding mask)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops first
        kwargs = kwargs or {}
        if func is aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if func is aten.bincount.default:
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            if minlength > 0:
                return torch.zeros(minlength, dtype=_bincount_dtype(weights), device=args[0].device)
        return func(*args, **kwargs)


def _bincount_dtype(weights: torch.Tensor | None) -> torch.dtype:
    """The dtype torch's ``bincount`` returns for ``weights`` (asked of torch on two real elements)."""
    with unset_fake_temporarily():
        w = None if weights is None else torch.zeros(1, dtype=weights.dtype)
        return torch.bincount(torch.zeros(1, dtype=torch.long), weights=w, minlength=1).dtype


# The training step: the estimate runs it on fake tensors, measure() on real ones


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
