"""Setting up one rank's run, top to bottom: validate, devices and mesh, model, data, optimizer,
resume. Each step lives in the module that owns it; this file only orders them and holds the
result (:class:`Run`), which the loop (:mod:`hf_tp.train.loop`) reads between steps."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from hf_tp.adapters.census import unrouted_expert_params
from hf_tp.checkpoint.dcp import load_checkpoint, load_trainer_state
from hf_tp.checkpoint.integrity import newest_good_checkpoint
from hf_tp.core.mesh import MeshSlices, stage_dims
from hf_tp.core.model_files import check_model_source
from hf_tp.data.steps import StepBatchSource
from hf_tp.data.streaming import StreamingBatchSource
from hf_tp.gpus import model_flops_per_token
from hf_tp.objectives.base import Objective
from hf_tp.parallel.linear_ce import fusable
from hf_tp.pipeline.schedules import Pipeline
from hf_tp.run.config import TrainConfig
from hf_tp.run.distributed import init_distributed, rank0_first, resolve_device
from hf_tp.run.errors import ERROR_DIR_ENV
from hf_tp.run.faults import Faults, apply_collective_timeout, register_rank
from hf_tp.run.model import build_parallel_model, compute_dtype
from hf_tp.run.optim import build_optimizer, build_scheduler, restore_schedule_position
from hf_tp.run.run_dir import check_output_dir, describe, replace_earlier_run, supersede_metrics, write_run_record
from hf_tp.run.validate import check_resume_compatible, run_fingerprint
from hf_tp.train.data import build_batches, saved_with_checkpoints, with_document_masking_checked
from hf_tp.train.evaluation import EvalSet
from hf_tp.train.metrics import peak_flops
from hf_tp.train.objective import Staged, build_objective
from hf_tp.train.pair_evaluation import PairEvalSet
from hf_tp.train.pipeline_run import build_pipeline, parameter_count, summed_over_stages
from hf_tp.train.pipeline_stepper import PipelineStepper
from hf_tp.train.stepper import PlainStepper, Stepper


@dataclass
class Run:
    """Everything one rank's training needs between steps (built once by :func:`set_up`)."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    model: torch.nn.Module
    tokenizer: object  # saved with checkpoints: the tokenizer, or the processor for image + text data
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    batches: StepBatchSource | StreamingBatchSource
    eval_set: EvalSet | PairEvalSet | None
    dp_group: dist.ProcessGroup
    fingerprint: dict
    fused: bool
    faults: Faults  # stop signals noted from set-up on (hf_tp.run.faults)
    objective: Objective  # cross entropy or a preference loss (hf_tp.train.objective)
    stepper: Stepper  # each step's forward and backward: plain or pipelined (hf_tp.train.stepper)
    route_group: dist.ProcessGroup | None = None  # the ranks whose tokens differ: dp, or dp x cp (MoE aux loss)
    start_step: int = 0
    resumed_from: Path | None = None  # the checkpoint this run continues (--resume)
    flops_per_token: float = 0.0
    peak_flops: float | None = None
    pipeline: Pipeline | None = None  # --pp: this rank's stages (model is the first of their HF models)

    @property
    def evaluated(self) -> torch.nn.Module | Pipeline:
        """What evaluation runs: the model, or (--pp) this rank's stages (hidden states passed on)."""
        return self.pipeline or self.model

    @property
    def saved_model(self) -> torch.nn.Module:
        """What checkpoints save and load: the model, or (--pp) this rank's stages as one module."""
        return self.pipeline.checkpoint_model if self.pipeline else self.model

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0


def set_up(cfg: TrainConfig) -> Run:
    """This rank's run, ready for its first step (the step after the checkpoint with ``--resume``)."""
    # 1. validate: the settings alone, identically on every rank, before any collective
    cfg = cfg.resolve()
    cfg.validate()
    out = Path(cfg.output_dir)
    check_output_dir(out, cfg)
    check_model_source(cfg.model)  # a local folder's weights and tokenizer files are there and whole
    # 2. devices and mesh; a stop signal from now on is noted and obeyed after the first step
    faults = Faults()
    device = resolve_device(cfg)
    init_distributed(device)
    register_rank(os.environ.get(ERROR_DIR_ENV))
    root = cfg.dims.build_mesh(device.type)
    mesh = root[stage_dims(root)] if cfg.pp > 1 else root  # a pipeline stage's mesh: the rest of the dims
    torch.manual_seed(cfg.seed)
    # 3. model: its config checked against tp/ep, built on meta, parallelized, each rank's shards read
    tokenizer = rank0_first(lambda: AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code))
    pipeline = build_pipeline(cfg, root, device) if cfg.pp > 1 else None  # this rank's stages of the model
    model = pipeline.models[0] if pipeline else build_parallel_model(cfg, mesh, device)
    # 4. data: this dp rank's batches of every step, and the evaluation set
    cfg = with_document_masking_checked(cfg, model)
    batches, eval_set = build_batches(cfg, tokenizer, root.get_local_rank("dp"), device)
    # 5. the objective (DPO's reference model built here), optimizer and schedule
    slices = MeshSlices.of(mesh)  # the stage's named slices, read once
    route_group = slices.dp.get_group()  # dp, or dp x cp
    # --pp: the objective gives the last stage its loss (DPO's reference pipelined like the policy)
    staged = Staged(pipeline, root) if pipeline else None
    objective = build_objective(cfg, model, mesh, device, route_group, batches, staged)
    if isinstance(eval_set, PairEvalSet):
        eval_set.bind(objective, slices.rows.get_group())
    opt = build_optimizer((pipeline or model).parameters(), cfg.lr, cfg.weight_decay, device)
    params = parameter_count(pipeline, device) if pipeline else sum(p.numel() for p in model.parameters())
    unrouted = unrouted_expert_params(model, model.config)
    if pipeline:  # each stage holds its layers' experts
        unrouted = summed_over_stages(unrouted, pipeline, device)
    run = Run(
        cfg=cfg,
        out=out,
        device=device,
        model=model,
        tokenizer=saved_with_checkpoints(batches, tokenizer),
        opt=opt,
        sched=build_scheduler(opt, cfg),
        batches=batches,
        eval_set=eval_set,
        dp_group=slices.rows.get_group(),
        route_group=route_group,
        fingerprint=run_fingerprint(cfg, model.config),
        fused=not pipeline and fusable(model),
        flops_per_token=model_flops_per_token(model.config, params, cfg.seq_len, unrouted),
        peak_flops=peak_flops(device, compute_dtype(cfg, device)),
        faults=faults,
        objective=objective,
        stepper=_stepper(cfg, pipeline or model, device, slices.rows.get_group(), route_group),
        pipeline=pipeline,
    )
    # 6. resume: weights, optimizer, schedule and data position from the newest checkpoint
    run.start_step = resume(run)
    # 7. the run is accepted: only now is its directory touched (rank 0)
    if run.is_main:
        accept(run)
    apply_collective_timeout(cfg.collective_timeout)  # set-up (downloads, loading) keeps torch's default
    return run


def _stepper(
    cfg: TrainConfig,
    model: torch.nn.Module | Pipeline,
    device: torch.device,
    dp_group: dist.ProcessGroup,
    route_group: dist.ProcessGroup,
) -> Stepper:
    """The run's stepper: the whole model's, or (--pp) the pipeline's."""
    if isinstance(model, Pipeline):
        return PipelineStepper(model, device, cfg.dp, dp_group, cfg.loss_parallel, cfg.aux_loss_over)
    return PlainStepper(model, device, cfg.dp, dp_group, route_group, cfg.loss_parallel, cfg.aux_loss_over)


def accept(run: Run) -> None:
    """Rank 0: move an earlier run aside (``--overwrite``), set aside the metrics records a resumed
    run writes again, and write the run's record (:mod:`hf_tp.run.run_dir`)."""
    cfg, out = run.cfg, run.out
    if cfg.overwrite and not cfg.resume and (moved := replace_earlier_run(out)) is not None:
        print(
            f"hf-tp: --overwrite: the earlier run in {out} ({describe(moved)}) was moved to {moved}; delete it to free its space"
        )
    if cfg.resume and (n := supersede_metrics(out / "metrics.jsonl", run.start_step)):
        print(f"hf-tp: {n} metrics records after step {run.start_step} moved to {out / 'metrics.superseded.jsonl'}")
    write_run_record(out, cfg, run.start_step, run.resumed_from)


def resume(run: Run) -> int:
    """Load the newest complete checkpoint when ``--resume``; return the step to continue from."""
    if not run.cfg.resume:
        return 0
    say = print if run.is_main else (lambda line: None)
    ckpt = newest_good_checkpoint(run.out, say)  # damaged newer ones named and skipped (every rank alike)
    if ckpt is None:
        if run.is_main:
            print(f"hf-tp: --resume: no complete checkpoint in {run.out / 'checkpoints'}; starting from step 0")
        return 0
    saved = load_trainer_state(ckpt)
    check_resume_compatible(saved["fingerprint"], run.fingerprint, ckpt)
    load_checkpoint(ckpt, run.saved_model, run.opt)
    restore_schedule_position(run.sched, saved["scheduler"])
    if isinstance(run.batches, StreamingBatchSource):
        run.batches.resume_at(int(saved["step"]), saved["data_position"])
    if run.is_main:
        print(f"hf-tp: resumed from {ckpt} (step {saved['step']})")
    run.resumed_from = ckpt
    return int(saved["step"])
