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

import torch.distributed as dist

from hf_tp.checkpoint.dcp import crash_point, save_checkpoint
from hf_tp.checkpoint.integrity import newest_good_checkpoint
from hf_tp.data.steps import StepBatches
from hf_tp.data.streaming import StreamingBatchSource
from hf_tp.run.config import TrainConfig
from hf_tp.run.distributed import shutdown
from hf_tp.run.errors import ERROR_DIR_ENV
from hf_tp.run.faults import apply_collective_timeout, heartbeat, is_timeout, record_preempted, timeout_error
from hf_tp.train.metrics import MetricsLogger, peak_memory_mib
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
                record = run.eval_set.record(
                    step + 1, run.evaluated, loss_parallel=run.cfg.loss_parallel, fused=run.fused
                )
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
    """Forward/backward over this rank's micro-batches (the run's stepper), then clip and step."""
    cfg = run.cfg
    share = run.stepper.forward_backward(batches, run.objective)
    # The next step's batches are collated while the device still runs this backward (the loss
    # check below waits for it).
    upcoming = run.batches(step + 1) if step + 1 < cfg.max_steps else None
    totals = run.stepper.totals(share, batches.num_examples)
    grad_norm = run.stepper.clip(cfg.max_grad_norm)
    loss_value, norm_value = totals.loss.item(), grad_norm.item()
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
    return _StepDone(loss_value, norm_value, lr, upcoming, totals.aux, totals.metrics)


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
