"""Checkpoint and export round trips of the layout under test.

Resume: the trained candidate is saved with the training loop's checkpoint writer, loaded into a
model on another mesh of the same ranks (DCP reshards weights and AdamW state), which then takes
one more step: it must reproduce the reference's next step. Export: rank 0 turns the checkpoint
into a ``from_pretrained`` folder (LoRA: merged) that plain HF loads; its weights must be the
reference's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hf_tp.checkpoint.dcp import load_checkpoint, save_checkpoint
from hf_tp.core.mesh import build_mesh
from hf_tp.run.config import TrainConfig
from hf_tp.verify.compare import Error, tensor_error


def save(cfg: TrainConfig, out: Path, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    """The candidate's checkpoint after ``cfg.max_steps`` steps, as the loop writes it."""
    base = getattr(model, "get_base_model", lambda: model)()
    files = [base.config, getattr(base, "generation_config", None)]
    state = {"config": cfg.to_dict(), "base_model": cfg.model}
    return save_checkpoint(out, cfg.max_steps, model, opt, state, [f for f in files if f is not None])


def other_layouts(cfg: TrainConfig) -> list[TrainConfig]:
    """Meshes of the same ranks to resume on, in order of preference: all data parallel, then all
    tensor parallel, then tp 2 (the first that the model takes is used)."""
    world = cfg.world_size
    shapes = [(1, world), (world, 1)] + ([(2, world // 2)] if world % 2 == 0 else [])
    current = (cfg.tp, cfg.dp) if cfg.cp == 1 and cfg.ep == 1 else None
    others = [
        dataclasses.replace(cfg, tp=tp, dp=dp, cp=1, ep=1) for tp, dp in dict.fromkeys(shapes) if (tp, dp) != current
    ]
    return others or [cfg]  # one rank: resumed on the same mesh


def resume_model(cfg: TrainConfig, device: torch.device, lora_state: dict | None, build) -> tuple:
    """(config, model, optimizer, rank) of the first other layout the model takes; ``build`` is
    :func:`hf_tp.verify.candidate.run`. Its refusals are raised before any collective, the same on
    every rank, so trying the next one is safe."""
    refusals = []
    for other in other_layouts(cfg):
        try:
            mesh = build_mesh(tp=other.tp, dp=other.dp, device_type=device.type)
            return (other, *build(other, mesh, device, lora_state, None))
        except ValueError as exc:
            refusals.append(f"tp {other.tp} x dp {other.dp}: {exc}")
    raise ValueError("no other mesh of these ranks takes the model: " + "; ".join(refusals))


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    load_checkpoint(path, model, opt)


def export_error(ckpt: Path, out: Path, snapshot: nn.Module, lora: bool) -> Error:
    """On rank 0: export ``ckpt`` to ``out`` and compare what ``from_pretrained`` loads from it with
    ``snapshot`` (the reference after the same steps; a LoRA model merged)."""
    from hf_tp.checkpoint.hf_folder import export_checkpoint
    from hf_tp.core.model_source import ModelSource

    folder = export_checkpoint(ckpt, out, overwrite=True, merge=lora)
    loaded = ModelSource.at(folder).load(dtype=torch.float32)
    want = snapshot.merge_and_unload() if lora else snapshot
    got_params = {n: p.detach() for n, p in loaded.named_parameters()}
    want_params = {n: p.detach().cpu() for n, p in want.named_parameters()}
    return tensor_error(got_params, want_params)


def on_rank0(fn) -> Error:
    """``fn()`` on rank 0 (an exception becomes an error naming it), its result sent to every rank."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as exc:  # noqa: BLE001 - reported as the check's failure on every rank
            box[0] = Error(
                float("inf"), float("inf"), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
    dist.broadcast_object_list(box, src=0)
    return box[0]
