"""A ``--pp`` run's model: this rank's pipeline stages of the checkpoint, each parallelized over the
rest of the mesh and filled with its own shards (:mod:`hf_tp.pipeline.schedules`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.checkpoint.load import materialize_and_load
from hf_tp.lora.peft_models import freeze_in_dtype, lora_init_state
from hf_tp.pipeline.pipeline_build import pipeline_parallelize
from hf_tp.pipeline.schedules import Pipeline
from hf_tp.run.config import TrainConfig
from hf_tp.run.model import compute_dtype, init_lora, parallelize_settings, unparallelized_model, with_lora


def build_pipeline(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device) -> Pipeline:
    """Build the model on the meta device, cut this rank's stages from it and parallelize each over
    ``mesh`` without its ``pp`` dim, then read each stage's shards from the files. ``--lora-r``:
    the adapters are added to the whole model, and each stage keeps its share of the whole
    model's initial adapters (the same at any pp)."""
    model, model_dir, fused = unparallelized_model(cfg, device)
    lora = with_lora(model, cfg)
    if cfg.lora_r:
        freeze_in_dtype(lora, compute_dtype(cfg, device))
    adapters = lora_init_state(model, cfg.seed) if cfg.lora_r else None  # drawn in the whole model's order
    pipe = pipeline_parallelize(
        lora,
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
    for stage_model in pipe.models if adapters is not None else ():
        init_lora(stage_model, adapters)
    return pipe


def parameter_count(pipe: Pipeline, device: torch.device) -> int:
    """The whole model's parameter count (every stage's, summed over the pp ranks, a tied weight
    once; collective)."""
    return summed_over_stages(sum(p.numel() for p in pipe.counted_parameters()), pipe, device)


def summed_over_stages(value: int, pipe: Pipeline, device: torch.device) -> int:
    """``value``, a count of this rank's stages, summed over the pp ranks (collective)."""
    count = torch.tensor(float(value), device=device, dtype=torch.float64)
    dist.all_reduce(count, group=pipe.group)
    return int(count.item())
