"""The one interface every training objective has: a micro-batch in, its share of the step's loss
and its metric sums out. The stepper (:mod:`hf_tp.train.stepper`) sums the losses (already divided
by the whole global batch's count) and the metric sums over micro-batches and dp ranks, and the
sums are divided by the global batch's examples; neither knows which objective it runs.

Under pipeline parallelism the model's forward is spread over stages: the objective gives the
batch the stages run (:meth:`Objective.staged`) and the loss on the last stage's logits
(:meth:`Objective.last_stage_loss`), the same loss :meth:`Objective.micro_loss` computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from hf_tp.data.steps import StepBatches


@dataclass
class MicroLoss:
    """One micro-batch's result. ``loss`` is its share of the step's loss: the sum over every
    micro-batch of every dp rank is the step's loss. ``aux`` is a MoE's unweighted router aux loss
    (None without one). ``sums`` are metric totals over the micro-batch's examples (``{"rewards/chosen":
    sum over its pairs}``): the step's metric is their sum over all ranks / the global batch's
    examples (:attr:`StepBatches.num_examples`)."""

    loss: torch.Tensor
    aux: torch.Tensor | None = None
    sums: dict[str, torch.Tensor] = field(default_factory=dict)


LOSS_ONLY = ("ref_logps",)  # batch entries the loss reads that are no model input (--precompute-ref's)


class Objective(Protocol):
    """A training objective (cross entropy, DPO, SimPO, ...)."""

    name: str
    metric_names: tuple[str, ...]  # the keys of :attr:`MicroLoss.sums`, the same on every rank

    def micro_loss(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        step: StepBatches,
        *,
        aux_weight: float = 1.0,
        routing: torch.Tensor | None = None,
    ) -> MicroLoss:
        """``batch``'s share of the step's loss; ``aux_weight`` / ``routing``: a MoE's aux loss
        (:func:`hf_tp.run.loss.training_loss`), for the objectives that train MoE routers."""
        ...

    def staged(self, batch: dict[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
        """``batch`` as a pipeline runs it, split into ``chunks`` equal runs of rows (its
        micro-batches), each of which :meth:`last_stage_loss` must be able to score alone, with
        what that loss reads besides the logits (a reference's log-probs: computed here, on every
        rank, before the stages run)."""
        ...

    def last_stage_loss(
        self, model: nn.Module, logits: torch.Tensor, batch: dict[str, torch.Tensor], step: StepBatches
    ) -> MicroLoss:
        """The loss (and metric sums) of ``batch``'s rows, one run of :meth:`staged`'s rows, from the
        ``logits`` of the pipeline's last stage ``model`` (its HF model): :meth:`micro_loss`'s
        loss without the router aux loss, which the stages add themselves."""
        ...
