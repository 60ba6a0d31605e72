"""Preference objectives on pairs (:mod:`hf_tp.data.pairs`: a micro-batch's B chosen rows, then
its B rejected rows): DPO's sigmoid loss against a reference model, and SimPO's, which needs none.

Both are means over the global batch's pairs (each micro-batch's sum divided by the global pair
count), so any split of the global batch over dp ranks and micro-steps gives the same loss as
one device; the logged metrics are TRL's, means over the same pairs. A MoE policy whose config
asks for transformers' router aux loss (``output_router_logits``) adds it as SFT does, computed
from the policy's forward over the pair rows (never the reference's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_tp.data.steps import StepBatches
from hf_tp.moe.aux_loss import router_aux_term
from hf_tp.objectives.base import MicroLoss
from hf_tp.objectives.reference import model_inputs
from hf_tp.parallel.logps import logits_log_probs, sequence_log_probs

Reference = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # a pair batch -> its rows' log-probs


def _sigmoid_loss(delta: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """Per pair: -(1 - e) log s(beta delta) - e log s(-beta delta) (e = 0: DPO's sigmoid loss)."""
    return -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing


METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)  # TRL's logged names


def _metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict[str, torch.Tensor]:
    """TRL's logged names (:data:`METRICS`), as sums over this micro-batch's pairs."""
    c, r = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    logps = (chosen_logps.detach().float().sum(), rejected_logps.detach().float().sum())
    return dict(zip(METRICS, (c.sum(), r.sum(), (c - r).sum(), (c > r).float().sum(), *logps), strict=True))


def pairs_in_chunks(batch: dict[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
    """A pair batch's rows reordered so that each of ``chunks`` equal runs of them (a pipeline's
    micro-batches) is a pair batch itself: its pairs' chosen rows, then their rejected rows."""
    pairs = batch["input_ids"].shape[0] // 2
    if pairs % chunks:
        raise ValueError(f"{pairs} preference pairs do not split into {chunks} pipeline micro-batches of whole pairs")
    per = pairs // chunks
    order = torch.arange(2 * pairs, device=batch["input_ids"].device).view(2, chunks, per).transpose(0, 1).reshape(-1)
    return {k: v[order] for k, v in batch.items()}


def _policy(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    aux_weight: float,
    routing: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float, torch.Tensor | None]:
    """The policy forward: (per-row log-probs, label counts, the aux loss term the objective adds,
    the unweighted aux loss or None). A MoE with transformers' aux loss (``output_router_logits``)
    adds ``router_aux_loss_coef * aux_weight`` times this rank's term of the global batch's aux loss
    over the pair rows, as SFT adds it (:func:`hf_tp.run.loss.training_loss`); the reference
    forward adds none."""
    out = sequence_log_probs(model, model_inputs(batch), router_logits=True)
    if out.router_logits is None:
        return out.logps, out.counts, 0.0, None
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    aux = router_aux_term(hf_model, out.router_logits, batch.get("attention_mask"), group, routing)
    return out.logps, out.counts, hf_model.config.router_aux_loss_coef * aux_weight * aux, aux.detach()


@dataclass
class DPO:
    """DPO (Rafailov et al. 2023), TRL's ``loss_type="sigmoid"``: with d = (log pi(c) - log ref(c))
    - (log pi(r) - log ref(r)), summed over each completion's tokens, the loss is -log s(beta d);
    ``label_smoothing`` e > 0 gives conservative DPO's -(1-e) log s(beta d) - e log s(-beta d).
    Rewards are beta times each side's log-ratio."""

    reference: Reference
    beta: float = 0.1
    label_smoothing: float = 0.0
    route_group: dist.ProcessGroup | None = None  # a MoE's aux loss: the ranks whose rows differ
    name: str = "dpo"
    metric_names: tuple[str, ...] = METRICS

    def micro_loss(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        step: StepBatches,
        *,
        aux_weight: float = 1.0,
        routing: torch.Tensor | None = None,
    ) -> MicroLoss:
        logps, _, aux_term, aux = _policy(model, batch, self.route_group, aux_weight, routing)
        out = self._loss(logps, self.reference(batch), step)
        return MicroLoss(out.loss + aux_term, aux, out.sums)

    def staged(self, batch: dict[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
        return pairs_in_chunks({**batch, "ref_logps": self.reference(batch)}, chunks)

    def last_stage_loss(
        self, model: nn.Module, logits: torch.Tensor, batch: dict[str, torch.Tensor], step: StepBatches
    ) -> MicroLoss:
        return self._loss(logits_log_probs(model, logits, batch["labels"]).logps, batch["ref_logps"], step)

    def _loss(self, logps: torch.Tensor, ref: torch.Tensor, step: StepBatches) -> MicroLoss:
        """The pairs' loss share and metric sums from their rows' policy and reference log-probs."""
        n = logps.shape[0] // 2
        chosen_ratio, rejected_ratio = logps[:n] - ref[:n], logps[n:] - ref[n:]
        losses = _sigmoid_loss(chosen_ratio - rejected_ratio, self.beta, self.label_smoothing)
        sums = _metrics(self.beta * chosen_ratio, self.beta * rejected_ratio, logps[:n], logps[n:])
        return MicroLoss(losses.sum() / step.num_examples, None, sums)


@dataclass
class SimPO:
    """SimPO (Meng et al. 2024), TRL's CPO ``loss_type="simpo"`` with ``cpo_alpha=0``: with each
    completion's mean token log-prob a, the loss is -log s(beta (a(c) - a(r)) - gamma); no
    reference model. Rewards are beta times each side's mean log-prob."""

    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    route_group: dist.ProcessGroup | None = None  # a MoE's aux loss: the ranks whose rows differ
    name: str = "simpo"
    metric_names: tuple[str, ...] = METRICS

    def micro_loss(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        step: StepBatches,
        *,
        aux_weight: float = 1.0,
        routing: torch.Tensor | None = None,
    ) -> MicroLoss:
        logps, counts, aux_term, aux = _policy(model, batch, self.route_group, aux_weight, routing)
        out = self._loss(logps, counts, step)
        return MicroLoss(out.loss + aux_term, aux, out.sums)

    def staged(self, batch: dict[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
        return pairs_in_chunks(batch, chunks)

    def last_stage_loss(
        self, model: nn.Module, logits: torch.Tensor, batch: dict[str, torch.Tensor], step: StepBatches
    ) -> MicroLoss:
        return self._loss(*logits_log_probs(model, logits, batch["labels"])[:2], step)

    def _loss(self, logps: torch.Tensor, counts: torch.Tensor, step: StepBatches) -> MicroLoss:
        """The pairs' loss share and metric sums from their rows' summed log-probs and label counts."""
        mean = logps / counts.clamp(min=1)
        n = logps.shape[0] // 2
        delta = mean[:n] - mean[n:] - self.gamma / self.beta
        losses = _sigmoid_loss(delta, self.beta, self.label_smoothing)
        sums = _metrics(self.beta * mean[:n], self.beta * mean[n:], mean[:n], mean[n:])
        return MicroLoss(losses.sum() / step.num_examples, None, sums)
