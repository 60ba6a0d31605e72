"""The layout under test: the model built as ``hf-tp train`` builds it (meta device, parallelize,
each rank reading its shards from the saved folder), trained with the training loop's own loss
(:func:`hf_tp.run.loss.training_loss`), its dp factor and its exact gradient clipping."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.context.token_share import state_of
from hf_tp.core.mesh import dp_mesh_of, split_mesh
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.parallel.linear_ce import fusable
from hf_tp.run.config import TrainConfig
from hf_tp.run.loss import loss_context, training_loss
from hf_tp.run.model import build_parallel_model
from hf_tp.verify.compare import full, full_buffers, full_grads, full_params
from hf_tp.verify.injected_faults import after_build, while_building
from hf_tp.verify.random_model import targets
from hf_tp.verify.single_rank import Settings, Trace, inputs, optimizer


def build(cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, lora_state: dict | None, fault: str | None):
    """The parallel model of ``cfg`` (``cfg.model``: the saved folder) on ``mesh``; LoRA factors
    from ``lora_state`` (the reference's)."""
    with while_building(fault):
        model = build_parallel_model(cfg, mesh, device)
    if lora_state:
        # a copy: set_model_state_dict puts the shards it makes into the dict it is given
        state = {k: v.clone() for k, v in lora_state.items()}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    after_build(model, fault)
    return model


@dataclasses.dataclass
class Rank:
    """This rank's place in the layout: its rows of the global batch and its groups."""

    mesh: DeviceMesh
    dp: int
    loss_parallel: bool
    fused: bool  # the loss fused with the lm_head, decided as the loop decides it: once, right after the build

    def rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per = batch["input_ids"].shape[0] // self.dp
        start = per * self.mesh.get_local_rank("dp")
        return {k: v[start : start + per] for k, v in batch.items()}

    def row_slice(self, rows: int) -> slice:
        per = rows // self.dp
        return slice(per * self.mesh.get_local_rank("dp"), per * (self.mesh.get_local_rank("dp") + 1))

    @property
    def route_group(self) -> dist.ProcessGroup | None:
        outer = split_mesh(self.mesh)[0]
        return outer.get_group() if outer is not None else None


def first_forward(model: nn.Module, batch: dict[str, torch.Tensor], rank: Rank) -> torch.Tensor:
    """This rank's logits of its rows (its tokens under context parallelism), global over the vocab."""
    with torch.no_grad(), loss_context(rank.loss_parallel):
        logits = model(**inputs(rank.rows(batch)), use_cache=False).logits
    return full(logits).detach().clone()


def want_logits(model: nn.Module, reference: torch.Tensor, rank: Rank) -> torch.Tensor:
    """The reference logits of the rows and tokens :func:`first_forward` gives on this rank."""
    rows = reference[rank.row_slice(reference.shape[0])]
    cp = state_of(model)
    return rows if cp is None else cp.layout.take(rows)


def train(model: nn.Module, opt, batch: dict[str, torch.Tensor], rank: Rank, s: Settings, steps: int) -> Trace:
    """``steps`` optimizer steps of the training loop on this rank's rows of ``batch``."""
    trace = Trace(start=full_params(model, trainable_only=True), buffers=full_buffers(model))
    local, count = rank.rows(batch), targets(batch)
    for step in range(steps):
        with loss_context(rank.loss_parallel):
            loss, _ = training_loss(model, local, count, rank.fused, rank.route_group)
            # the loss is over the global target count: the dp ranks' gradients add up (FSDP2 averages)
            (loss * rank.dp).backward()
        total = full(loss).detach().float().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_mesh_of(rank.mesh).get_group())
        trace.losses.append(total.item())
        if step == 0:
            trace.grads = full_grads(model)
        trace.grad_norms.append(clip_grad_norm(model.parameters(), s.max_grad_norm).item())
        trace.step_grads.append(full_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    trace.params = full_params(model, trainable_only=True)
    return trace


def run(
    cfg: TrainConfig, mesh: DeviceMesh, device: torch.device, lora_state: dict | None, fault: str | None
) -> tuple[nn.Module, torch.optim.Optimizer, Rank]:
    """Build the candidate and its optimizer (as the loop builds it: fused AdamW on GPUs)."""
    model = build(cfg, mesh, device, lora_state, fault)
    rank = Rank(mesh, cfg.dp, cfg.loss_parallel, fusable(model))
    return model, optimizer(model, settings_of(cfg), fused=device.type == "cuda"), rank


def settings_of(cfg: TrainConfig) -> Settings:
    return Settings(steps=cfg.max_steps, lr=cfg.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
