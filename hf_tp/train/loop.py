"""The per-rank training loop: mesh -> model -> parallelize -> data -> optimizer steps.

One implementation serves ``hf-tp train`` and the Python API (``hf_tp.train``). The loss is the
token mean over the whole global batch (every dp rank and micro-step), so any (tp, dp, batch,
grad_accum) split of the same global batch gives single-device training's loss curve.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_cosine_with_min_lr_schedule_with_warmup
from transformers.utils import logging as hf_logging

from hf_tp.checkpoint.dcp import crash_point, latest_checkpoint, load_checkpoint, load_trainer_state, save_checkpoint
from hf_tp.checkpoint.load import build_empty, local_model_dir, materialize_and_load, safetensors_keys
from hf_tp.data import GlobalBatchPlan, PadToMultipleCollator, load_text_dataset, tokenize_dataset
from hf_tp.data.steps import StepBatchSource
from hf_tp.parallel import build_mesh, loss_parallel, parallelize
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.parallel.linear_ce import fusable, training_loss
from hf_tp.train.config import TrainConfig
from hf_tp.train.metrics import MetricsLogger, flops_per_token, peak_flops, peak_memory_mib
from hf_tp.train.profile import StepProfiler, parse_profile_steps
from hf_tp.train.validate import check_output_dir, check_resume_compatible, run_fingerprint, validate_model_config

T = TypeVar("T")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    output_dir: Path | None = None
    checkpoint: Path | None = None
    export: Path | None = None


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is visible")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> None:
    """Join the process group that the launcher described in the environment (or a 1-rank one)."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a single process started by hand: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def build_model(cfg: TrainConfig, mesh, device: torch.device) -> torch.nn.Module:
    """Build the model on the meta device, parallelize it, then let each rank read only its shards
    of the safetensors files (fp32 master weights). Folders without safetensors fall back to a
    full ``from_pretrained`` on every rank."""
    if dist.get_rank() != 0:
        hf_logging.disable_progress_bar()  # one progress bar, not one per rank
    model_dir = rank0_first(lambda: local_model_dir(cfg.model))
    config = AutoConfig.from_pretrained(model_dir)
    validate_model_config(config, cfg)
    sharded = safetensors_keys(model_dir) is not None
    if sharded:
        model = build_empty(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    mp = None
    if _compute_dtype(cfg, device) == torch.bfloat16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    parallelize(
        model,
        mesh,
        sequence_parallel=cfg.sequence_parallel,
        loss_parallel=cfg.loss_parallel,
        mp_policy=mp,
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
    )
    if sharded:
        materialize_and_load(model, model_dir, device)
    return model


def build_data(cfg: TrainConfig, tokenizer):
    raw = rank0_first(lambda: load_text_dataset(cfg.dataset, text_column=cfg.text_column))
    return rank0_first(
        lambda: tokenize_dataset(raw, tokenizer, text_column=cfg.text_column, seq_len=cfg.seq_len, pack=cfg.pack)
    )


def train(cfg: TrainConfig) -> TrainResult:
    """Run a whole training on this rank (inside already-started processes)."""
    cfg = cfg.resolve()
    cfg.validate()
    device = resolve_device(cfg)
    init_distributed(device)
    rank = dist.get_rank()
    out = Path(cfg.output_dir)
    check_output_dir(out, cfg)
    mesh = build_mesh(tp=cfg.tp, dp=cfg.dp, device_type=device.type)
    dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    torch.manual_seed(cfg.seed)

    tokenizer = rank0_first(lambda: AutoTokenizer.from_pretrained(cfg.model))
    model = build_model(cfg, mesh, device)
    data = build_data(cfg, tokenizer)
    plan = GlobalBatchPlan(num_examples=len(data), global_batch=cfg.global_batch, seed=cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collate = PadToMultipleCollator(pad_token_id=pad_id, multiple_of=cfg.tp)

    # Fused AdamW on GPUs: one kernel for the whole update (also the HF Trainer's default there).
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
        fused=device.type == "cuda" or None,
    )
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps, min_lr_rate=cfg.min_lr_ratio
    )
    fingerprint = run_fingerprint(cfg, model.config)
    start_step = resume(cfg, out, model, opt, sched, fingerprint)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.yaml")
        truncate_metrics(out / "metrics.jsonl", start_step)
    num_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model.config, num_params, cfg.seq_len)
    peak = peak_flops(device, _compute_dtype(cfg, device))
    logger = MetricsLogger(out, cfg.max_steps, enabled=rank == 0, tensorboard=cfg.tensorboard, start_step=start_step)
    result = TrainResult(output_dir=out)
    ctx = loss_parallel if cfg.loss_parallel else _null
    fused = fusable(model)

    fetch = StepBatchSource(
        data, plan, collate, dp_rank, cfg.dp, micro_batch=cfg.batch_size, grad_accum=cfg.grad_accum, device=device
    )
    upcoming = None
    profiler = StepProfiler(parse_profile_steps(cfg.profile_steps), out / "profile", rank, device, start_step + 1)
    try:
        for step in range(start_step, cfg.max_steps):
            crash_point("train", step + 1)
            t0 = time.perf_counter()
            batches = upcoming or fetch(step)
            local_loss = torch.zeros((), device=device)
            for m, batch in enumerate(batches.micro_batches):
                _set_grad_sync(model, m == len(batches.micro_batches) - 1)
                with ctx():
                    loss = training_loss(model, batch, batches.num_targets, fused)
                    # The loss is already divided by the global token count, so the dp ranks'
                    # gradients must be summed; FSDP2 averages them, hence the factor dp. (FSDP2's
                    # set_gradient_divide_factor(1) needs PREMUL_SUM, which gloo lacks.)
                    (loss * cfg.dp).backward()
                local_loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
            # The next step's batches are collated while the device still runs this backward
            # (the loss check below waits for it).
            upcoming = fetch(step + 1) if step + 1 < cfg.max_steps else None
            dist.all_reduce(local_loss, op=dist.ReduceOp.SUM, group=dp_group)
            grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm)
            loss_value, norm_value = local_loss.item(), grad_norm.item()
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                raise FloatingPointError(
                    f"loss is {loss_value} (grad norm {norm_value}) at step {step + 1}: stopping before the "
                    "optimizer step; no checkpoint was written over the last good one. Lower --lr, check the data, "
                    "or use --dtype fp32"
                )
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            result.losses.append(loss_value)
            result.grad_norms.append(norm_value)
            profiler.step()
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps:
                record = {
                    "step": step + 1,
                    "loss": loss_value,
                    "grad_norm": norm_value,
                    "lr": lr,
                    "tokens": batches.tokens,
                    "tokens_per_sec": batches.tokens / dt,
                    "step_time_s": dt,
                }
                if peak is not None:
                    record["mfu"] = fpt * batches.tokens / dt / (peak * dist.get_world_size())
                record.update(peak_memory_mib(device))
                logger.log(record)
            final = step + 1 == cfg.max_steps
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or (
                final and (cfg.save_every or cfg.export_on_finish)
            ):
                state = {"scheduler": sched.state_dict(), "fingerprint": fingerprint, "config": cfg.to_dict()}
                result.checkpoint = save_checkpoint(
                    out,
                    step + 1,
                    model,
                    opt,
                    state,
                    [model.config, model.generation_config, tokenizer],
                    keep=cfg.keep_checkpoints,
                )
    finally:
        profiler.close()
        logger.close()
    if cfg.export_on_finish:
        from hf_tp.checkpoint.export import export_checkpoint

        dist.barrier()
        ckpt = result.checkpoint or latest_checkpoint(out)
        if rank == 0:
            result.export = export_checkpoint(ckpt, out / "export", overwrite=True)
            print(f"hf-tp: exported {result.checkpoint.name} to {result.export}")
        dist.barrier()
    if rank == 0 and result.losses:
        print(
            f"hf-tp: {len(result.losses)} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; "
            f"metrics in {out / 'metrics.jsonl'}"
        )
    return result


def resume(cfg: TrainConfig, out: Path, model, opt, sched, fingerprint: dict) -> int:
    """Load the newest complete checkpoint when ``--resume``; return the step to continue from."""
    if not cfg.resume:
        return 0
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        if dist.get_rank() == 0:
            print(f"hf-tp: --resume: no complete checkpoint in {out / 'checkpoints'}; starting from step 0")
        return 0
    saved = load_trainer_state(ckpt)
    check_resume_compatible(saved["fingerprint"], fingerprint, ckpt)
    load_checkpoint(ckpt, model, opt)
    sched.load_state_dict(saved["scheduler"])
    if dist.get_rank() == 0:
        print(f"hf-tp: resumed from {ckpt} (step {saved['step']})")
    return int(saved["step"])


def truncate_metrics(path: Path, keep_steps: int) -> None:
    """Drop records after the resumed step (written by the run that crashed), atomically."""
    if keep_steps == 0 or not path.exists():
        return
    import json

    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= keep_steps]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(ln + "\n" for ln in lines))
    os.replace(tmp, path)


def _set_grad_sync(model: torch.nn.Module, sync: bool) -> None:
    """Reduce-scatter gradients only on the last micro-step of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def shutdown() -> None:
    """Leave the process group cleanly (a barrier first: a rank that exits while another is still
    in a collective makes gloo abort)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
