"""The per-rank training loop: set up -> optimizer steps (metrics, checkpoints) -> end of run.

One implementation serves ``hf-tp train`` and the Python API (:func:`hf_tp.fit`). The loss is the
token mean over the whole global batch (every dp rank and micro-step), so any (tp, dp, batch,
grad_accum) split of the same global batch gives single-device training's loss curve.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hf_tp.checkpoint.dcp import crash_point, save_checkpoint
from hf_tp.checkpoint.integrity import newest_good_checkpoint
from hf_tp.data.steps import StepBatches
from hf_tp.data.streaming import StreamingBatchSource
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.train.config import TrainConfig
from hf_tp.train.distributed import shutdown
from hf_tp.train.errors import ERROR_DIR_ENV
from hf_tp.train.faults import apply_collective_timeout, heartbeat, is_timeout, record_preempted, timeout_error
from hf_tp.train.loss import loss_context, step_routing
from hf_tp.train.metrics import MetricsLogger, peak_memory_mib
from hf_tp.train.pipeline_run import pipeline_clip, pipeline_micro_loss, pipeline_routing
from hf_tp.train.profile import StepProfiler, parse_profile_steps
from hf_tp.train.setup import Run, set_up

__all__ = ["TrainResult", "shutdown", "train"]
EXPORT_WAIT_S = 24 * 3600.0  # how long the other ranks may wait for rank 0's export (it grows with the model)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)  # optimizer step -> held-out loss
    output_dir: Path | None = None
    checkpoint: Path | None = None  # the newest checkpoint this run wrote (None if it wrote none)
    export: Path | None = None
    preempted_at: int | None = None  # the step after which a stop signal (SIGTERM, SIGUSR1) ended the run


def train(cfg: TrainConfig) -> TrainResult:
    """Run a whole training on this rank (inside already-started processes).

    ``model``/``dataset`` left as None train the embedded tiny Llama on its generated corpus."""
    from hf_tp.train.embedded_run import with_embedded_default

    run = set_up(with_embedded_default(cfg))
    result = TrainResult(output_dir=run.out)
    logger = MetricsLogger(
        run.out,
        run.cfg.max_steps,
        enabled=run.is_main,
        report_to=run.cfg.reporters,
        start_step=run.start_step,
        run_config=run.cfg.to_dict(),
    )
    profiler = StepProfiler(
        parse_profile_steps(run.cfg.profile_steps), run.out / "profile", dist.get_rank(), run.device, run.start_step + 1
    )
    step = run.start_step
    try:
        upcoming = None
        for step in range(run.start_step, run.cfg.max_steps):
            crash_point("train", step + 1)
            heartbeat(step + 1)
            t0 = time.perf_counter()
            batches = upcoming or run.batches(step)
            done = _optimizer_step(run, step, batches)
            dt = time.perf_counter() - t0
            upcoming = done.upcoming
            result.losses.append(done.loss)
            result.grad_norms.append(done.grad_norm)
            profiler.step()
            if (step + 1) % run.cfg.log_every == 0 or step + 1 == run.cfg.max_steps:
                logger.log(_metrics_record(run, step, batches, done, dt))
            if run.eval_set is not None and run.eval_set.due(step + 1, run.cfg.eval_every, run.cfg.max_steps):
                evaluated = run.pipeline or run.model  # --pp: the stages' forward, hidden states passed on
                record = run.eval_set.record(step + 1, evaluated, loss_parallel=run.cfg.loss_parallel, fused=run.fused)
                result.eval_losses[step + 1] = record["eval_loss"]
                logger.log_eval(record)
            saved = _checkpoint_due(run.cfg, step + 1)
            if saved:
                result.checkpoint = _save(run, step + 1)
            if step + 1 < run.cfg.max_steps and run.faults.stop_agreed(run.device):
                result.checkpoint = result.checkpoint if saved else _save(run, step + 1)
                result.preempted_at = step + 1
                break
    except RuntimeError as exc:
        if is_timeout(exc):
            raise timeout_error(step + 1, run.cfg.collective_timeout) from None
        raise
    finally:
        run.faults.close()
        profiler.close()
        logger.close()
    _finish(run, result)
    return result


@dataclass
class _StepDone:
    loss: float  # the global batch's token-mean loss
    grad_norm: float  # before clipping
    lr: float  # the rate this step used
    upcoming: StepBatches | None  # the next step's batches, collated while the backward ran
    aux_loss: float | None = None  # a MoE's router load-balancing loss (included in loss, times its coef)
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's (preference rewards, log-probs)


def _optimizer_step(run: Run, step: int, batches: StepBatches) -> _StepDone:
    """Forward/backward over this rank's micro-batches, then clip and step."""
    cfg, model = run.cfg, run.model
    local_loss = torch.zeros((), device=run.device)
    aux_sum = torch.zeros((), device=run.device)  # the router aux loss (MoE), summed over micro-batches
    has_aux = False
    micro = len(batches.micro_batches)
    # A MoE's aux loss: over the whole step's rows of every dp rank, the router's counts found
    # first (each micro-step's term is then its share: weight 1); or, --aux-loss-over micro-batch,
    # over each micro-step's rows, the micro-steps weighing equally (1/grad_accum).
    over_step = micro == 1 or cfg.aux_loss_over == "step"
    if run.pipeline is not None:  # --pp: every stage's routers, routed through the pipeline first
        routing = pipeline_routing(run.pipeline, batches.micro_batches, over_step)
    else:
        routing = step_routing(model, batches.micro_batches, run.route_group) if micro > 1 and over_step else None
    weight = 1.0 if over_step else 1 / micro
    sums: dict[str, torch.Tensor] = {}  # the objective's metric totals over this rank's examples
    for m, batch in enumerate(batches.micro_batches):
        _set_grad_sync(model, m == micro - 1)
        if run.pipeline is not None:  # --pp: torch's schedule runs forward and backward of every stage
            _set_grad_sync(run.pipeline.models, m == micro - 1)  # reduced over dp after the last micro-step
            with loss_context(cfg.loss_parallel):
                loss, aux = pipeline_micro_loss(run.pipeline, batch, batches.num_targets, cfg.dp, routing, weight, m)
            local_loss += loss.float()
            if aux is not None:
                aux_sum += aux * weight
                has_aux = True
            continue
        with loss_context(cfg.loss_parallel):
            out = run.objective.micro_loss(model, batch, batches, aux_weight=weight, routing=routing)
            loss, aux = out.loss, out.aux
            for name, value in out.sums.items():
                sums[name] = sums.get(name, 0) + value
            if aux is not None:
                aux_sum += aux.float() * weight
                has_aux = True
            # The loss is already divided by the global token count, so the dp ranks' gradients
            # must be summed; FSDP2 averages them, hence the factor dp. (FSDP2's
            # set_gradient_divide_factor(1) needs PREMUL_SUM, which gloo lacks.)
            (loss * cfg.dp).backward()
        local_loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
    # The next step's batches are collated while the device still runs this backward (the loss
    # check below waits for it).
    upcoming = run.batches(step + 1) if step + 1 < cfg.max_steps else None
    dist.all_reduce(local_loss, op=dist.ReduceOp.SUM, group=run.dp_group)
    if run.pipeline is not None:  # the loss is the last stage's
        dist.all_reduce(local_loss, op=dist.ReduceOp.SUM, group=run.pipeline.group)
    if has_aux:  # the ranks' terms add up to the global batch's aux loss
        dist.all_reduce(aux_sum, op=dist.ReduceOp.SUM, group=run.dp_group)
        if run.pipeline is not None:  # each stage's layers' share
            dist.all_reduce(aux_sum, op=dist.ReduceOp.SUM, group=run.pipeline.group)
    metrics = _global_means(sums, batches.num_examples, run.dp_group)
    pipe = run.pipeline  # --pp: every stage's gradients in one norm, a tied weight's copies summed first
    grad_norm = (
        pipeline_clip(pipe, cfg.max_grad_norm) if pipe else clip_grad_norm(model.parameters(), cfg.max_grad_norm)
    )
    loss_value, norm_value = local_loss.item(), grad_norm.item()
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        bf16 = cfg.compute_dtype_name(run.device.type) == "bf16"
        raise FloatingPointError(
            f"loss is {loss_value} (grad norm {norm_value}) at step {step + 1}: stopping before the "
            "optimizer step; no checkpoint was written over the last good one. Lower --lr or check the data"
            + (", or use --dtype fp32 (this run computes in bf16)" if bf16 else "")
        )
    lr = run.sched.get_last_lr()[0]
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    return _StepDone(loss_value, norm_value, lr, upcoming, aux_sum.item() if has_aux else None, metrics)


def _global_means(sums: dict[str, torch.Tensor], examples: int, dp_group: dist.ProcessGroup) -> dict[str, float]:
    """The objective's metric totals summed over the dp ranks, per example of the global batch."""
    if not sums:
        return {}
    names = sorted(sums)
    total = torch.stack([sums[n].detach().float() for n in names])
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
    return {n: v / examples for n, v in zip(names, total.tolist(), strict=True)}


def _metrics_record(run: Run, step: int, batches: StepBatches, done: _StepDone, dt: float) -> dict:
    """One metrics.jsonl record of 0-based step ``step``."""
    record = {
        "step": step + 1,
        "loss": done.loss,
        "grad_norm": done.grad_norm,
        "lr": done.lr,
        **({"aux_loss": done.aux_loss} if done.aux_loss is not None else {}),
        **done.metrics,
        "tokens": batches.tokens,
        "target_tokens": batches.num_targets,
        "tokens_per_sec": batches.tokens / dt,
        "step_time_s": dt,
    }
    if run.peak_flops is not None:
        record["mfu"] = run.flops_per_token * batches.tokens / dt / (run.peak_flops * dist.get_world_size())
    if run.cfg.predicted_speed is not None:  # hf-tp train --layout auto --gpu's plan, beside the measurement
        record.update(predicted_tokens_per_sec=run.cfg.predicted_speed, predicted_mfu=run.cfg.predicted_mfu)
    record.update(peak_memory_mib(run.device))
    return record


def _checkpoint_due(cfg: TrainConfig, done: int) -> bool:
    """Every ``save_every`` steps, and at the end when checkpoints or an export are asked for."""
    final = done == cfg.max_steps
    return bool(cfg.save_every and done % cfg.save_every == 0) or (
        final and bool(cfg.save_every or cfg.export_on_finish)
    )


def _save(run: Run, done: int) -> Path:
    state = {"scheduler": run.sched.state_dict(), "fingerprint": run.fingerprint, "config": run.cfg.to_dict()}
    if isinstance(run.batches, StreamingBatchSource):
        state["data_position"] = run.batches.state_for(done)  # where the stream continues after step `done`
    files = [run.model.config, run.model.generation_config, run.tokenizer]
    return save_checkpoint(run.out, done, run.saved_model, run.opt, state, files, keep=run.cfg.keep_checkpoints)


def _finish(run: Run, result: TrainResult) -> None:
    """Export (``--export-on-finish``) and print the summary on rank 0; after a stop signal, say
    where the checkpoint is instead."""
    if result.preempted_at is not None:
        line = (
            f"hf-tp: preempted at step {result.preempted_at} ({run.faults.received or 'a signal to another rank'}): "
            f"checkpoint {result.checkpoint} saved; continue with --resume"
        )
        if run.is_main:
            print(line, flush=True)
            record_preempted(os.environ.get(ERROR_DIR_ENV), line)
        return
    if run.cfg.export_on_finish:
        from hf_tp.checkpoint.hf_folder import export_checkpoint

        apply_collective_timeout(EXPORT_WAIT_S)  # the other ranks wait while rank 0 exports
        dist.barrier()
        # A resumed run that was already at max_steps took no step and wrote no checkpoint: export
        # the newest one on disk.
        ckpt = result.checkpoint or newest_good_checkpoint(run.out, print if run.is_main else lambda line: None)
        if ckpt is None:
            raise ValueError(f"--export-on-finish: no complete checkpoint in {run.out / 'checkpoints'} to export")
        if run.is_main:
            result.export = export_checkpoint(ckpt, run.out / "export", overwrite=True)
            print(f"hf-tp: exported {ckpt.name} to {result.export}")
        dist.barrier()
    if not run.is_main:
        return
    if result.losses:
        print(
            f"hf-tp: {len(result.losses)} steps, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; "
            f"metrics in {run.out / 'metrics.jsonl'}"
        )
    else:
        print(f"hf-tp: nothing to train: the run in {run.out} is already at --max-steps {run.cfg.max_steps}")


def _set_grad_sync(model: torch.nn.Module | list[torch.nn.Module], sync: bool) -> None:
    """Reduce-scatter gradients only on the last micro-step of an accumulation."""
    for m in model if isinstance(model, list) else [model]:
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(sync)
