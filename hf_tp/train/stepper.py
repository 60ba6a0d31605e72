"""One optimizer step's forward and backward, whatever runs the model: the loop holds one stepper,
chosen at set-up, and never asks how the model is laid out. :class:`PlainStepper` runs the
objective's :meth:`~hf_tp.objectives.base.Objective.micro_loss` on the whole (parallelized) model;
the pipelined one (:class:`hf_tp.train.pipeline_stepper.PipelineStepper`) runs torch's schedule
over the stages, the objective giving the last stage its loss. Both give the same numbers: the
loss, the MoE aux loss and the objective's metrics of the global batch, and the clipped norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hf_tp.data.steps import StepBatches
from hf_tp.objectives.base import Objective
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.run.loss import loss_context, step_routing


@dataclass
class StepShare:
    """This rank's share of a step, before any reduction over ranks: the loss, the MoE router aux
    loss (each micro-step's times its weight; ``has_aux`` False without one) and the objective's
    metric sums."""

    loss: torch.Tensor
    aux: torch.Tensor
    has_aux: bool = False
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def zeros(cls, device: torch.device) -> StepShare:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))

    def add(self, loss: torch.Tensor, aux: torch.Tensor | float | None, weight: float, sums: dict) -> None:
        """Add one micro-step's loss, its unweighted aux loss (``weight``: the micro-step's share)
        and its metric sums."""
        self.loss += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
        if aux is not None:
            self.aux += aux.float() * weight if isinstance(aux, torch.Tensor) else aux * weight
            self.has_aux = True
        for name, value in sums.items():
            self.sums[name] = self.sums.get(name, 0) + value

    @property
    def aux_value(self) -> float | None:
        return self.aux.item() if self.has_aux else None


@dataclass
class StepTotals:
    """A step's numbers over the whole global batch (every rank holds them)."""

    loss: torch.Tensor  # the global batch's loss (a MoE's weighted aux loss included)
    aux: float | None  # the router aux loss (None without one)
    metrics: dict[str, float]  # the objective's, per example of the global batch


class Stepper(Protocol):
    """What the loop runs each optimizer step (forward and backward, reductions, clipping)."""

    def forward_backward(self, batches: StepBatches, objective: Objective) -> StepShare:
        """Forward and backward over this rank's micro-batches of the step; gradients accumulate."""
        ...

    def totals(self, share: StepShare, examples: int) -> StepTotals:
        """The step's numbers, ``share`` summed over the ranks that hold parts of them (collective)."""
        ...

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient to one global norm (0: only measure) and return it (collective)."""
        ...


def aux_split(micro: int, aux_loss_over: str) -> tuple[bool, float]:
    """(over the step, each micro-step's weight) of a MoE's aux loss: over the whole step's rows of
    every dp rank, the router's counts found first (each micro-step's term is then its share:
    weight 1); or, ``--aux-loss-over micro-batch``, over each micro-step's rows, the micro-steps
    weighing equally (1 / grad_accum)."""
    over_step = micro == 1 or aux_loss_over == "step"
    return over_step, 1.0 if over_step else 1 / micro


def set_grad_sync(models: list[torch.nn.Module], sync: bool) -> None:
    """Reduce-scatter gradients only on the last micro-step of an accumulation."""
    for m in models:
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(sync)


def global_means(sums: dict[str, torch.Tensor], examples: int, dp_group: dist.ProcessGroup) -> dict[str, float]:
    """The objective's metric totals summed over the dp ranks, per example of the global batch."""
    if not sums:
        return {}
    names = sorted(sums)
    total = torch.stack([sums[n].detach().float() for n in names])
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
    return {n: v / examples for n, v in zip(names, total.tolist(), strict=True)}


@dataclass
class PlainStepper:
    """The whole model on this rank's mesh (TP+SP, FSDP2, cp, ep): the objective's ``micro_loss``."""

    model: torch.nn.Module
    device: torch.device
    dp: int
    dp_group: dist.ProcessGroup
    route_group: dist.ProcessGroup | None  # the ranks whose tokens differ: dp, or dp x cp (MoE aux loss)
    loss_parallel: bool
    aux_loss_over: str = "step"

    def forward_backward(self, batches: StepBatches, objective: Objective) -> StepShare:
        micro = len(batches.micro_batches)
        over_step, weight = aux_split(micro, self.aux_loss_over)
        routing = step_routing(self.model, batches.micro_batches, self.route_group) if micro > 1 and over_step else None
        share = StepShare.zeros(self.device)
        for m, batch in enumerate(batches.micro_batches):
            set_grad_sync([self.model], m == micro - 1)
            with loss_context(self.loss_parallel):
                out = objective.micro_loss(self.model, batch, batches, aux_weight=weight, routing=routing)
                # The loss is already divided by the global token count, so the dp ranks' gradients
                # must be summed; FSDP2 averages them, hence the factor dp. (FSDP2's
                # set_gradient_divide_factor(1) needs PREMUL_SUM, which gloo lacks.)
                (out.loss * self.dp).backward()
            share.add(out.loss, out.aux, weight, out.sums)
        return share

    def totals(self, share: StepShare, examples: int) -> StepTotals:
        dist.all_reduce(share.loss, op=dist.ReduceOp.SUM, group=self.dp_group)
        if share.has_aux:  # the ranks' terms add up to the global batch's aux loss
            dist.all_reduce(share.aux, op=dist.ReduceOp.SUM, group=self.dp_group)
        return StepTotals(share.loss, share.aux_value, global_means(share.sums, examples, self.dp_group))

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), max_norm)
