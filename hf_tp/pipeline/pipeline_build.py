"""``hf_tp.pipeline_parallelize``: cut a HF causal LM into this rank's pipeline stages and
parallelize each over the rest of the mesh."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.adapters import PlanOptions, get_adapter
from hf_tp.context.context_install import check_context_parallel
from hf_tp.core.dims import V_SHAPED, check_pipeline, check_tied_schedule
from hf_tp.core.mesh import MeshSlices, stage_dims
from hf_tp.lora.peft_models import unwrap_peft
from hf_tp.moe.expert_parallel import build_ep_mesh, check_experts, experts_modules
from hf_tp.parallel.api import parallelize
from hf_tp.parallel.tp import check_plan_paths, embeddings_tied
from hf_tp.pipeline.pipeline_fsdp import fsdp_roots, keep_gathered
from hf_tp.pipeline.pipeline_split import balanced_cuts, check_splittable, cut_stage, layer_costs
from hf_tp.pipeline.schedules import Pipeline, StageModule


def pipeline_parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    device: torch.device | None = None,
    **parallelize_kwargs,
) -> Pipeline:
    """Cut ``model`` into ``pp x virtual_stages`` stages by decoder layers, balanced by each layer's
    cost, keep this rank's (``mesh``'s ``"pp"`` coordinate, + v * pp for the v-th virtual stage),
    and :func:`hf_tp.parallelize` each over ``mesh`` without its pp dim. ``model`` itself becomes
    this rank's last stage (the others are copies of it, cut before any is parallelized).

    A peft LoRA model is copied whole and each copy's HF model cut in place, so a stage keeps
    every name (adapters' included) and :func:`hf_tp.parallelize` gives it LoRA's plans; the
    :class:`Pipeline`'s models are then the HF models inside (as ``hf-tp train`` keeps them).

    Context (a ``cp`` dim) and expert parallelism (``ep``) apply inside each stage as to a whole
    model. A weight tied across stages (``lm_head`` and the embedding) is held by the first and last
    stage, whose gradients :meth:`Pipeline.sync_tied_grads` sums before each optimizer step.

    Refused here (one line each): multimodal wrappers, a tied weight under a V-shaped schedule
    (``zbv``, ``dualpipev``: both copies on one rank), and families whose forward changes the
    hidden states outside the decoder layers."""
    pp, rank = mesh["pp"].size(), mesh.get_local_rank("pp")
    outer, model = model, unwrap_peft(model)[0]
    adapter = get_adapter(model.config)
    costs = layer_costs(model, adapter.layers_path)
    check_pipeline(pp, schedule, microbatches, virtual_stages, len(costs))
    check_splittable(model, adapter)
    tied = embeddings_tied(model)  # before the cut: every rank alike
    check_tied_schedule(tied, schedule)
    stage_mesh = mesh[stage_dims(mesh)]
    slices = MeshSlices.of(stage_mesh)  # the stage's named slices, read once
    _check_whole_model(model, adapter, slices, parallelize_kwargs)
    cuts = balanced_cuts(costs, pp * virtual_stages)
    ids = [rank, 2 * pp - 1 - rank] if schedule in V_SHAPED else [rank + v * pp for v in range(virtual_stages)]
    tops = [copy.deepcopy(outer) if k < len(ids) - 1 else outer for k in range(len(ids))]
    models = [
        cut_stage(unwrap_peft(top)[0], adapter, cuts[i], copy_model=False) for top, i in zip(tops, ids, strict=True)
    ]
    stages = []
    for top, stage_model in zip(tops, models, strict=True):
        parallelize(top, stage_mesh, **_stage_settings(stage_model, adapter, slices, schedule, parallelize_kwargs))
        stages.append(StageModule(stage_model, slices.tp))
    roots = fsdp_roots(models)  # (torch's FSDP2 internals checked before any step)
    if schedule in V_SHAPED:  # the weight gradients come after FSDP2's hooks (hf_tp.pipeline.pipeline_fsdp)
        keep_gathered(roots)
    device = device or next(iter(models[0].parameters())).device
    route_group = slices.dp.get_group() if slices.dp is not None else None
    tied_group = _first_and_last_stage_group(mesh) if tied else None
    return Pipeline(
        stages,
        ids,
        pp * virtual_stages,
        mesh["pp"].get_group(),
        schedule,
        microbatches,
        device,
        route_group,
        tied_group,
    )


def _first_and_last_stage_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of this rank's (dp, tp) coordinate's first and last pp ranks, which hold
    the two copies of a tied embedding (the pp group itself at pp 2). Every rank creates every
    coordinate's group, as torch requires, and keeps its own (None if it holds neither copy)."""
    pp = mesh["pp"].size()
    if pp == 2:
        return mesh["pp"].get_group()
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).reshape(pp, -1)
    mine = None
    for first, last in zip(ranks[0].tolist(), ranks[-1].tolist(), strict=True):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    return mine


def _check_whole_model(model: nn.Module, adapter, slices: MeshSlices, settings: dict) -> None:
    """The checks that read the decoder layers, on the whole model before the cut, so every rank
    refuses alike (a stage's own checks see only its layers: a rank whose stage holds no Mamba
    layer would go on while another stops): the plan's module paths, context and expert
    parallelism."""
    tp = slices.tp.size()
    adapter.validate(model.config, tp)
    opts = PlanOptions(
        sequence_parallel=settings.get("sequence_parallel", True),
        loss_parallel=settings.get("loss_parallel", True),
        kv_replicas=adapter.kv_replicas(model.config, tp),
    )
    check_plan_paths(model, adapter, opts)
    cp, ep = slices.cp, settings.get("ep", 1)
    if cp is not None:
        check_context_parallel(model, adapter.layers_path, cp.size())
    if ep > 1:
        if not adapter.moe:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model; {model.config.model_type} has no experts")
        check_experts(model, adapter.layers_path, adapter.experts, ep)


def _stage_settings(stage_model: nn.Module, adapter, slices: MeshSlices, schedule: str, settings: dict) -> dict:
    """:func:`hf_tp.parallelize`'s settings for one stage: ``ep`` 1 for a stage without MoE
    layers (a model's first dense layers), its ep groups built all the same (every rank of the
    world creates every process group); under a V-shaped schedule with FSDP2 no fused reduction
    of tp-``Partial`` gradients (:mod:`hf_tp.parallel.partial_grads` adds them to FSDP2's sharded
    gradients at each backward's end, but the split backward keeps the units gathered through the
    step, :mod:`hf_tp.pipeline.pipeline_fsdp`: FSDP2 reduces each of those gradients itself)."""
    dp_mesh = slices.dp
    if schedule in V_SHAPED and dp_mesh is not None and (dp_mesh.size() > 1 or settings.get("mp_policy") is not None):
        settings = {**settings, "fuse_partial_grads": False}
    ep = settings.get("ep", 1)
    if ep > 1 and not experts_modules(stage_model, adapter.layers_path, adapter.experts):
        build_ep_mesh(slices.mesh, ep)
        return {**settings, "ep": 1}
    return settings
