"""The one interface every training objective has: a micro-batch in, its share of the step's loss
and its metric sums out. The loop sums the losses (already divided by the whole global batch's
count) and the metric sums over micro-batches and dp ranks, and divides the sums by the global
batch's examples; it does not know which objective it runs."""

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


class Objective(Protocol):
    """A training objective (cross entropy, DPO, SimPO, ...)."""

    name: str

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
        (:func:`hf_tp.train.loss.training_loss`), for the objectives that train MoE routers."""
        ...
