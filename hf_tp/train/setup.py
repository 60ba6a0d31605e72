"""Setting up a rank: device, process group, model, data, optimizer; and leaving the group.

Each function is one step of :func:`hf_tp.train.loop.train`'s set-up, kept apart so the estimate
(:mod:`hf_tp.estimate.step`) builds its optimizer exactly as the loop does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from hf_tp.checkpoint.load import (
    build_empty,
    files_match_model,
    local_model_dir,
    materialize_and_load,
    safetensors_keys,
)
from hf_tp.parallel import parallelize
from hf_tp.train.config import TrainConfig
from hf_tp.train.launch import free_port
from hf_tp.train.validate import device_type, validate_model_config

T = TypeVar("T")
ADAMW_BETAS = (0.9, 0.95)


def resolve_device(cfg: TrainConfig) -> torch.device:
    """CPU, or this rank's GPU (``LOCAL_RANK``)."""
    if device_type(cfg) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> None:
    """Join the process group that the launcher described in the environment (or a 1-rank one)."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a single process started by hand: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def shutdown(exit_code: int | None = None) -> None:
    """Leave the process group together with the other ranks: a barrier (a rank that quits while
    a peer is still in a collective with it fails the peer: "Connection closed by peer"), then
    ``destroy_process_group``. For the success path only: a failed rank must not wait for others.

    That does not stop gloo's worker threads while DTensors and DeviceMeshes still reference the
    groups; one may still be freeing the last collective's tensors when the interpreter finalizes,
    which ends the process with "terminate called without an active exception" (SIGABRT), rarely,
    after all the work is done. With ``exit_code``, stdout/stderr are flushed and the process
    leaves with ``os._exit(exit_code)``, skipping finalization: use it where the process ends anyway
    (a script run on each rank), never inside a notebook or a test process.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def rank0_first(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0, then on the others (downloads and dataset caches are built once).

    An error on rank 0 is broadcast, so every rank raises it instead of waiting in a barrier.
    """
    err: list[tuple[bool, str] | None] = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
            err[0] = (isinstance(exc, ValueError), str(exc) if isinstance(exc, ValueError) else repr(exc))
            dist.broadcast_object_list(err, src=0)
            raise
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        is_value_error, message = err[0]
        raise (ValueError if is_value_error else RuntimeError)(message)
    return result if dist.get_rank() == 0 else fn()


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 on GPUs unless ``--dtype fp32``; fp32 on CPU unless ``--dtype bf16``."""
    return torch.bfloat16 if cfg.compute_dtype_name(device.type) == "bf16" else torch.float32


def mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy | None:
    """FSDP2's bf16 compute with fp32 master weights and gradient reductions; None for fp32."""
    if dtype == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def build_parallel_model(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
    """Build the model on the meta device, parallelize it, then let each rank read only its shards
    of the safetensors files (fp32 master weights). Folders without safetensors fall back to a
    full ``from_pretrained`` on every rank."""
    if dist.get_rank() != 0:
        hf_logging.disable_progress_bar()  # one progress bar, not one per rank
    model_dir = rank0_first(lambda: local_model_dir(cfg.model))
    config = AutoConfig.from_pretrained(model_dir)
    validate_model_config(config, cfg.tp, cfg.seq_len, ep=cfg.ep)
    model = build_empty(config) if safetensors_keys(model_dir) is not None else None
    # Files that need more than renames to become the model's tensors (a MoE checkpoint with one
    # tensor per expert, which transformers merges on load) go through from_pretrained instead.
    sharded = model is not None and files_match_model(model, model_dir)
    if not sharded:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    parallelize(
        model,
        mesh,
        sequence_parallel=cfg.sequence_parallel,
        loss_parallel=cfg.loss_parallel,
        mp_policy=mixed_precision(compute_dtype(cfg, device)),
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
        ep=cfg.ep,
    )
    if sharded:
        materialize_and_load(model, model_dir, device)
    return model


def with_document_masking_checked(cfg: TrainConfig, model: torch.nn.Module) -> TrainConfig:
    """``cfg``, with document masking turned off (and said so) for a model whose attention mask
    does not come from transformers' ``masking_utils`` (the code that turns restarting
    ``position_ids`` into per-document masks): there packed documents would see each other."""
    if not (cfg.pack and cfg.document_masking):
        return cfg
    # The MRO: FSDP2 subclasses the model's class (FSDPLlamaModel) in a module of its own.
    modules = [inspect.getmodule(cls) for cls in type(model.get_decoder()).__mro__]
    names = ("create_causal_mask", "create_sliding_window_causal_mask")
    if any(hasattr(module, name) for module in modules for name in names):
        return cfg
    if dist.get_rank() == 0:
        print(
            f"hf-tp: {model.config.model_type} does not build its attention mask with transformers' masking_utils; "
            "packed documents are not masked from each other (--no-document-masking)",
            file=sys.stderr,
        )
    return dataclasses.replace(cfg, document_masking=False)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95); fused on GPUs: one kernel for the whole update, no temporaries of
    the parameters' size (also the HF Trainer's default there)."""
    return torch.optim.AdamW(
        params, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay, fused=device.type == "cuda" or None
    )


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """The multiple of the peak lr at 0-based optimizer step ``step``: linear warmup
    ``(step + 1) / (warmup + 1)`` (so the first step already trains, at lr / (warmup + 1), and step
    ``warmup`` is the first at the peak), then cosine decay to ``min_ratio`` at step ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """:func:`lr_factor`: linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    factor = functools.partial(lr_factor, warmup=cfg.warmup_steps, total=cfg.max_steps, min_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def restore_schedule_position(sched: torch.optim.lr_scheduler.LRScheduler, state: dict) -> None:
    """Resume a :func:`build_scheduler` schedule at the saved step, keeping this run's shape.

    LambdaLR's ``state_dict`` also holds its lambda's arguments (the saving run's ``max_steps``);
    loading them would make a run resumed with a larger ``--max-steps`` keep decaying towards the
    old end. Only the position is restored, and the rate of that position recomputed (the
    optimizer's state, loaded before, holds the saving run's rate)."""
    sched.load_state_dict({**state, "lr_lambdas": [None] * len(state.get("lr_lambdas", []))})
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
    for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    sched._last_lr = lrs  # what get_last_lr() reports (LambdaLR keeps it in this attribute)
