"""A ``--pp`` run's model: this rank's pipeline stages of the checkpoint, each parallelized over the
rest of the mesh and filled with its own shards (:mod:`hf_tp.parallel.pipeline`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.checkpoint.load import materialize_and_load
from hf_tp.parallel.pipeline import Pipeline
from hf_tp.parallel.pipeline_build import pipeline_parallelize
from hf_tp.train.config import TrainConfig
from hf_tp.train.model import parallelize_settings, unparallelized_model


def build_pipeline(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device) -> Pipeline:
    """Build the model on the meta device, cut this rank's stages from it and parallelize each over
    ``mesh`` without its ``pp`` dim, then read each stage's shards from the files."""
    model, model_dir, fused = unparallelized_model(cfg, device)
    pipe = pipeline_parallelize(
        model,
        mesh,
        schedule=cfg.pp_schedule,
        microbatches=cfg.pipeline_microbatches,
        virtual_stages=cfg.pp_virtual_stages,
        device=device,
        **parallelize_settings(cfg, device),
    )
    if fused is not None:
        for stage_model in pipe.models:
            materialize_and_load(stage_model, model_dir, device, fused)
    return pipe


def parameter_count(pipe: Pipeline, device: torch.device) -> int:
    """The whole model's parameter count (every stage's, summed over the pp ranks; collective)."""
    return summed_over_stages(sum(p.numel() for p in pipe.parameters()), pipe, device)


def summed_over_stages(value: int, pipe: Pipeline, device: torch.device) -> int:
    """``value``, a count of this rank's stages, summed over the pp ranks (collective)."""
    count = torch.tensor(float(value), device=device, dtype=torch.float64)
    dist.all_reduce(count, group=pipe.group)
    return int(count.item())
