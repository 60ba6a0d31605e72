"""The stepper of a ``--pp`` run (:mod:`hf_tp.train.stepper`): torch's schedule runs every stage's
forward and backward, and the objective gives the last stage its loss
(:meth:`~hf_tp.objectives.base.Objective.last_stage_loss`), so every objective runs over a
pipeline. The loss and the objective's metrics are the last stage's, the MoE aux loss each
stage's layers' share: summed over the pipeline group as over dp."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_tp.data.steps import StepBatches
from hf_tp.moe.pipeline_aux import StageRouting
from hf_tp.objectives.base import LOSS_ONLY, Objective
from hf_tp.parallel.grad import clip_grad_norm
from hf_tp.pipeline.schedules import Pipeline
from hf_tp.run.loss import loss_context
from hf_tp.train.stepper import StepShare, StepTotals, aux_split, global_means, set_grad_sync


@dataclass
class PipelineStepper:
    """This rank's pipeline stages (:class:`hf_tp.pipeline.schedules.Pipeline`), stepped whole."""

    pipe: Pipeline
    device: torch.device
    dp: int
    dp_group: dist.ProcessGroup
    loss_parallel: bool
    aux_loss_over: str = "step"

    def forward_backward(self, batches: StepBatches, objective: Objective) -> StepShare:
        micro = len(batches.micro_batches)
        over_step, weight = aux_split(micro, self.aux_loss_over)
        pipe = self.pipe
        # a MoE's routing over the whole step's micro-batches, every stage's routers, found first
        routing = pipe.route(batches.micro_batches) if pipe.has_aux and over_step else None
        share = StepShare.zeros(self.device)
        share.sums = {name: torch.zeros((), device=self.device) for name in objective.metric_names}
        for m, batch in enumerate(batches.micro_batches):
            set_grad_sync(pipe.models, m == micro - 1)  # reduced over dp after the last micro-step
            with loss_context(self.loss_parallel):
                loss, aux, sums = self._micro_step(batch, batches, objective, routing, weight, m)
            share.add(loss, aux, weight, sums)
        return share

    def _micro_step(
        self,
        batch: dict[str, torch.Tensor],
        step: StepBatches,
        objective: Objective,
        routing: StageRouting | None,
        weight: float,
        index: int,
    ) -> tuple[torch.Tensor, float | None, dict[str, torch.Tensor]]:
        """(loss, aux, metric sums) of micro-step ``index``: this rank's share of the objective's loss
        (0 off the last stage) plus, for a MoE with transformers' aux loss, ``router_aux_loss_coef
        * weight`` times this rank's share of it; ``aux`` that unweighted share (None without one,
        or when the step's ``routing`` was counted at micro-step 0). Without the step's ``routing``
        the aux loss is this micro-step's rows'."""
        pipe = self.pipe
        own = routing if routing is not None else (pipe.route([batch]) if pipe.has_aux else None)
        staged = objective.staged(batch, pipe.microbatches)  # (DPO: the reference's forward first)
        chunks: dict[int, dict[str, torch.Tensor]] = {}  # each pipeline micro-batch's metric sums

        def last_stage_loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            out = objective.last_stage_loss(pipe.models[-1], logits, {k: v[rows] for k, v in staged.items()}, step)
            # (torch's stage set-up may score the first micro-batch on placeholder activations
            # before the schedule runs: its own call replaces those sums)
            chunks[int(rows[0])] = out.sums
            return out.loss

        inputs = {k: v for k, v in staged.items() if k not in LOSS_ONLY}
        totals = own.totals if own is not None else None
        loss = pipe.step(inputs, step.num_targets, self.dp, totals, weight, loss=last_stage_loss)
        sums: dict[str, torch.Tensor] = {}
        for part in chunks.values():
            for name, value in part.items():
                sums[name] = sums.get(name, 0) + value
        if own is None or (routing is not None and index > 0):
            return loss, None, sums
        return loss + pipe.models[0].config.router_aux_loss_coef * weight * own.term, own.term, sums

    def totals(self, share: StepShare, examples: int) -> StepTotals:
        for value in (share.loss, share.aux) if share.has_aux else (share.loss,):
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.dp_group)
            # the loss is the last stage's; the aux loss each stage's layers' share
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.pipe.group)
        if share.sums:  # the last stage's metric sums (zeros on the other stages)
            names = sorted(share.sums)
            total = torch.stack([share.sums[n].detach().float() for n in names])
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.pipe.group)
            share.sums = dict(zip(names, total, strict=True))
        return StepTotals(share.loss, share.aux_value, global_means(share.sums, examples, self.dp_group))

    def clip(self, max_norm: float) -> torch.Tensor:
        """Every stage's gradients in one norm: a tied weight's two copies get their summed gradient
        first and count once, as at pp 1."""
        pipe = self.pipe
        pipe.sync_tied_grads()
        return clip_grad_norm(pipe.counted_parameters(), max_norm, pipe.group, pipe.mirrors)
