"""Which objective a run trains (``--objective``), built once per rank (the data's fit is checked by
:func:`hf_tp.data.formats.preference.check_objective_data`)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.core.mesh import dp_mesh_of
from hf_tp.objectives.base import Objective
from hf_tp.objectives.pair_losses import DPO, SimPO
from hf_tp.objectives.precompute import Stored, with_reference_logps
from hf_tp.objectives.ref_cache import cache_key, cache_path, cached_reference_logps
from hf_tp.objectives.reference import AdaptersOff, FrozenCopy, StagedReference
from hf_tp.parallel.linear_ce import fusable
from hf_tp.parallel.logps import log_probs_refusal
from hf_tp.pipeline.schedules import Pipeline
from hf_tp.run.config import TrainConfig
from hf_tp.run.distributed import rank0_first
from hf_tp.run.loss import CrossEntropy


@dataclass
class Staged:
    """A ``--pp`` run's pipeline (this rank's stages) and the whole mesh it was cut over."""

    pipeline: Pipeline
    root: DeviceMesh


def build_objective(
    cfg: TrainConfig,
    model: torch.nn.Module,
    mesh: DeviceMesh,
    device: torch.device,
    route_group,
    batches,
    staged: Staged | None = None,
) -> Objective:
    """The run's objective; DPO's reference is the LoRA policy with its adapters off (``--lora-r``),
    else a frozen copy of the checkpoint built and sharded exactly like the policy (``staged``, a
    ``--pp`` run: pipelined like it). With ``--precompute-ref`` the reference scores every pair of
    ``batches`` (a :class:`hf_tp.data.steps.StepBatchSource`) once, here, and is freed; or an
    earlier run's scores of the same pairs are read from the dataset cache
    (:mod:`hf_tp.objectives.ref_cache`). Under ``--pp`` the loss is the last stage's, on its
    logits (the stages' HF forward, no fused lm_head)."""
    if cfg.objective == "sft":
        return CrossEntropy(not staged and fusable(model), route_group)
    why = None if staged else log_probs_refusal(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if why:
        raise ValueError(
            f"--objective {cfg.objective} needs the lm_head fused with the log-probs: {why}; use --objective sft"
        )
    if cfg.objective == "simpo":
        return SimPO(cfg.beta, cfg.simpo_gamma, cfg.label_smoothing, route_group)
    if cfg.precompute_ref:
        batches.data = _precomputed(cfg, model, mesh, device, batches, staged)
        return DPO(Stored(), cfg.beta, cfg.label_smoothing, route_group)
    return DPO(_reference(cfg, model, mesh, device, staged), cfg.beta, cfg.label_smoothing, route_group)


def _reference(cfg: TrainConfig, model: torch.nn.Module, mesh: DeviceMesh, device: torch.device, staged: Staged | None):
    """DPO's reference: the LoRA policy with its adapters off, or a frozen copy sharded like it
    (``staged``: either through pipeline stages)."""
    if cfg.lora_r:
        return StagedReference(staged.pipeline, adapters_off=True) if staged else AdaptersOff(model)
    from hf_tp.run.model import build_parallel_model
    from hf_tp.train.pipeline_run import build_pipeline

    if dist.get_rank() == 0:
        print("hf-tp: DPO reference: a frozen copy of the model, sharded like it", file=sys.stderr, flush=True)
    frozen = dataclasses.replace(cfg, lora_r=0)
    if staged:
        return StagedReference(build_pipeline(frozen, staged.root, device))
    return FrozenCopy(build_parallel_model(frozen, mesh, device))


def _precomputed(
    cfg: TrainConfig, model: torch.nn.Module, mesh: DeviceMesh, device: torch.device, batches, staged: Staged | None
):
    """The training pairs with the reference's log-probs: from the dataset cache when an earlier
    run (or this one before a --resume) scored the same pairs with the same reference, else scored
    here (the frozen copy built only then, and freed after)."""
    from hf_tp.core.model_source import local_model_dir

    model_dir = rank0_first(lambda: local_model_dir(cfg.model))
    path = cache_path(cache_key(model_dir, batches.data, cfg.seq_len, cfg.compute_dtype_name(device.type)))

    def compute():
        where = dict(dp_rank=batches.dp_rank, dp=batches.dp, group=dp_mesh_of(mesh).get_group(), device=device)
        reference = _reference(cfg, model, mesh, device, staged)
        return with_reference_logps(batches.data, reference, batches.collate, batch_size=cfg.batch_size, **where)

    data, computed = cached_reference_logps(batches.data, compute, path, device)
    if dist.get_rank() == 0:
        how = "computed and kept" if computed else "read from"
        print(f"hf-tp: --precompute-ref: reference log-probs of {len(data)} pairs {how} {path}", file=sys.stderr)
    return data
