"""Pipeline parallelism over a ``pp`` mesh dim with torch's own schedules (``torch.distributed.pipelining``).

Each rank holds one stage (``--pp-virtual-stages`` V > 1: V stages, ``rank + v * pp``) of the
unmodified HF model cut by decoder layers (:mod:`hf_tp.pipeline.pipeline_split`), each stage
parallelized (TP+SP, FSDP2, cp, ep) over the rest of the mesh as a whole model would be. A stage
passes its hidden states to the next as a plain tensor (under cp: this rank's tokens of the
load-balanced layout, which every stage shares; under tp: its sequence shard of them, rebuilt as
the same DTensor on the other side). The last stage's loss of a micro-batch is the objective's
(:meth:`Pipeline.step`'s ``loss``), by default its targets' summed cross entropy divided by the
global batch's target count (under cp: its tokens' targets, summed over the cp ranks), and
torch's schedule sums the micro-batches' gradients unscaled, so a step's gradient is exactly the
single-device one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard

from hf_tp.context.token_share import local_tokens, shift_labels, state_of, sum_over_cp
from hf_tp.core.dims import MULTI_STAGE, V_SHAPED
from hf_tp.core.record import record_of
from hf_tp.moe.aux_loss import router_aux_term, standard_aux_loss
from hf_tp.moe.pipeline_aux import SideLoss, StageRouting, holds_routers, route, routing_mask
from hf_tp.parallel.tp import embeddings_tied
from hf_tp.pipeline.pipeline_fsdp import fsdp_roots, hold_gradients, quiet_stage_views, release_gradients
from hf_tp.pipeline.pipeline_split import merged_stages

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "loopedbfs": ScheduleLoopedBFS,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


class StageModule(nn.Module):
    """What a :class:`PipelineStage` runs: one stage's HF model. The first stage takes token ids,
    the others the previous stage's hidden states (as ``inputs_embeds``); the last returns the
    logits, the others their hidden states as a plain tensor (this rank's cp tokens, their tp
    sequence shard)."""

    def __init__(self, model: nn.Module, tp_mesh):
        super().__init__()
        self.model = model
        stage = record_of(model).stage  # (hf_tp.core.record.StageRecord: set by the cut, kept by parallelize)
        self.first, self.last = stage.first, stage.last
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.seq_len = 0  # the step's row length, set before each step (rebuilds the tp shards' global shape)
        self.routing: torch.Tensor | None = None  # a MoE step's [counts..., rows] (hf_tp.moe.pipeline_aux)
        self.aux_scale = 0.0  # what the aux terms' gradients are scaled by (coef x weight x dp)
        self.routers = holds_routers(model)
        # A schedule that splits the backward (input, then weights) frees the stage's output in
        # place (``detach_``), which a view of the model's hidden states cannot be: hand on a copy.
        self.split_backward = False

    def forward(self, x: torch.Tensor, routing_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        out = self.with_aux(x, routing_mask, **kwargs)
        return out.clone() if self.split_backward and out._base is not None else out

    def with_aux(self, x: torch.Tensor, routing_mask: torch.Tensor | None, **kwargs) -> torch.Tensor:
        """The stage's output; with a MoE step's ``routing``, carrying its aux term's gradient."""
        if self.routing is None or not self.routers:
            return self.run(x, **kwargs)[0]
        out, logits = self.run(x, output_router_logits=True, **kwargs)
        if not any(layer is not None for layer in logits or ()):
            return out  # no router on this stage
        term = router_aux_term(self.model, logits, routing_mask, None, self.routing)
        return SideLoss.apply(out, term, self.aux_scale)

    def run(self, x: torch.Tensor, **kwargs) -> tuple[torch.Tensor, tuple | None]:
        """(this stage's output, its routers' logits when ``output_router_logits`` is passed)."""
        asks = kwargs.get("output_router_logits", getattr(self.model.config, "output_router_logits", False))
        if asks and not self.routers:  # a stage of dense layers: HF's aux loss would fail on no router logits
            kwargs["output_router_logits"] = False
        key = "input_ids" if self.first else "inputs_embeds"
        cp = state_of(self.model)
        seq = self.seq_len
        if cp is not None:  # the rows' length; a stage after the first is fed this rank's cp tokens
            cp.stage_seq = 0 if self.first else seq
            seq //= cp.layout.cp
        if not self.first and self.tp_mesh is not None:
            shape = (x.shape[0], seq, x.shape[2])
            stride = (shape[1] * shape[2], shape[2], 1)
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False, shape=shape, stride=stride)
        # Always the model's own forward (FSDP2's root unit gathers the embedding and norm there)
        result = self.model(**{key: x}, use_cache=False, **kwargs)
        routers = getattr(result, "router_logits", None)
        if self.last:
            return result.logits, routers
        head = self.model.lm_head  # a HeadGap: the hidden states it was given are this stage's output
        out, head.seen = head.seen, None
        if isinstance(out, DTensor):
            if tuple(out.placements) != (Shard(1),):
                raise ValueError(
                    f"--pp with tp needs the residual stream sharded over the sequence (sequence parallelism), "
                    f"got {out.placements}: drop --no-sequence-parallel"
                )
            out = out.to_local()
        return out, routers


def stage_cross_entropy(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor, num_items: int) -> torch.Tensor:
    """The last stage's loss of its rows' ``labels``: their targets' summed cross entropy divided by
    the global batch's ``num_items`` targets (under cp: this rank's tokens', summed over cp, so
    every cp rank holds the whole rows' loss)."""
    vocab = model.config.get_text_config().vocab_size
    # shifted over whole rows, then this rank's cp tokens (the rows themselves without cp)
    shifted = local_tokens(model, shift_labels(labels)).contiguous()
    loss = model.loss_function(logits, None, vocab, num_items_in_batch=num_items, shift_labels=shifted)
    return sum_over_cp(model, loss)


@dataclass
class Pipeline:
    """This rank's stages and how a step runs them (:meth:`step`)."""

    stages: list[StageModule]
    stage_ids: list[int]  # the global stage index of each
    num_stages: int
    group: dist.ProcessGroup  # the pp group of this rank's (dp, tp) coordinate
    schedule: str
    microbatches: int
    device: torch.device
    route_group: dist.ProcessGroup | None = None  # the stages' dp group (a MoE's routing counts over it)
    tied_group: dist.ProcessGroup | None = None  # a tied embedding: this coordinate's first and last stage ranks

    @property
    def models(self) -> list[nn.Module]:
        """The HF models of this rank's stages (disjoint parameters, original names)."""
        return [s.model for s in self.stages]

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def stage_rank(self, stage: int) -> int:
        """The pp rank that runs global stage ``stage`` (V-shaped schedules: rank r runs stages r
        and 2 pp - 1 - r; the others: stage % pp)."""
        pp = self.num_stages // len(self.stage_ids)
        if self.schedule in V_SHAPED:
            return stage if stage < pp else self.num_stages - 1 - stage
        return stage % pp

    def parameters(self):
        for model in self.models:
            yield from model.parameters()

    @property
    def tied(self) -> list[nn.Parameter]:
        """This rank's copies of a weight the model ties across stages: the embedding of the first
        stage (its ``lm_head`` gap holds it too), ``lm_head`` of the last (its idle embedding too)."""
        return [m.get_input_embeddings().weight for m in self.models if embeddings_tied(m)]

    @property
    def mirrors(self) -> list[nn.Parameter]:
        """The last stage's copy of a tied weight, if this rank holds it (the first stage's copy,
        with the same gradient once summed, stands for both in a norm or a count)."""
        return self.tied if self.has_last else []

    def counted_parameters(self):
        """:meth:`parameters` less :attr:`mirrors`: what the gradient norm and the parameter
        count take, as at pp 1."""
        mirror = {id(p) for p in self.mirrors}
        return (p for p in self.parameters() if id(p) not in mirror)

    def sync_tied_grads(self) -> None:
        """Sum the gradients of a tied weight's two copies (the embedding's on the first stage,
        ``lm_head``'s on the last) over ``tied_group``, so both hold the whole model's gradient and
        the optimizer keeps them equal. Collective over those ranks; once per optimizer step, after
        the last backward and before clipping (each rank's shard of either copy is the same slice:
        both stages are parallelized over the same dp x tp mesh alike)."""
        if self.tied_group is None:
            return
        with torch.no_grad():
            for p in self.tied:
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    # the embedding's backward under tp leaves a Replicate gradient: take this rank's shard
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=self.tied_group)

    @cached_property
    def checkpoint_model(self) -> nn.Module:
        """What a checkpoint saves and loads on this rank: its stage's HF model, or one module over
        its several stages' (:func:`hf_tp.pipeline.pipeline_split.merged_stages`); either way every
        parameter under the whole model's name, so a checkpoint is the same files at any pp."""
        return merged_stages(self.models)

    @cached_property
    def has_aux(self) -> bool:
        """The model adds transformers' router aux loss: :meth:`step` needs :meth:`route`'s counts."""
        return standard_aux_loss(self.models[0])

    def route(self, micro_batches: list[dict[str, torch.Tensor]]) -> StageRouting:
        """The routing counts of every stage and dp rank over ``micro_batches`` and this rank's
        share of their aux loss (collective; see :func:`hf_tp.moe.pipeline_aux.route`)."""
        return route(self, micro_batches)

    def step(
        self,
        batch: dict[str, torch.Tensor],
        num_items: int,
        dp: int,
        routing: torch.Tensor | None = None,
        aux_weight: float = 1.0,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch of this dp rank's rows over the pipeline; returns this
        rank's summed micro-batch losses (the loss of these rows divided by ``num_items``, the global
        batch's targets) on the last stage's ranks, 0 on the others. Gradients are the global batch
        token mean's times ``dp`` (FSDP2 averages over dp; the factor makes that the sum).

        ``routing`` (a MoE with transformers' aux loss: the ``totals`` of :meth:`route` over the
        rows the aux loss spans): each stage's gradients also get its layers' share of
        ``router_aux_loss_coef * aux_weight`` times the aux loss (whose value :meth:`route` gives:
        the returned loss is the cross entropy's alone).

        ``loss`` (the last stage's, for an objective other than cross entropy): ``(logits, rows)``
        -> the loss of ``batch``'s rows ``rows`` (the indices of one pipeline micro-batch's rows,
        equal runs of them) as a share of the global batch's loss; default: :func:`stage_cross_entropy`
        over ``num_items`` targets."""
        if routing is not None and (mask := routing_mask(batch)) is not None:
            batch = {**batch, "routing_mask": mask}
        batch = {k: v for k, v in batch.items() if k != "row_lengths"}
        input_ids, labels = batch.pop("input_ids"), batch.pop("labels")
        last_model = self.models[-1]
        if loss is None:

            def loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                return stage_cross_entropy(last_model, logits, labels[rows], num_items)

        def loss_fn(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return loss(logits, rows) * dp

        coef = float(getattr(last_model.config, "router_aux_loss_coef", 0.0) or 0.0) * aux_weight
        runtime = []
        for module, index in zip(self.stages, self.stage_ids, strict=True):
            module.seq_len, module.split_backward = input_ids.shape[1], self.schedule in V_SHAPED
            module.routing, module.aux_scale = routing, coef * dp
            runtime.append(PipelineStage(module, index, self.num_stages, self.device, group=self.group))
        cls = SCHEDULES[self.schedule]
        target = runtime if self.schedule in MULTI_STAGE else runtime[0]
        schedule = cls(target, n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=False)
        losses: list[torch.Tensor] = []
        args = (input_ids,) if 0 in self.stage_ids else ()
        roots = fsdp_roots(self.models)  # FSDP2 reduces once, after the step (hf_tp.pipeline.pipeline_fsdp)
        held = hold_gradients(roots, self.schedule in V_SHAPED)
        with quiet_stage_views():  # FSDP2's warning that a stage returned a view (harmless here)
            rows = torch.arange(input_ids.shape[0], device=input_ids.device) if self.has_last else None
            schedule.step(*args, target=rows, losses=losses, return_outputs=False, **batch)
        release_gradients(roots, held)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for loss in losses:
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().double() / dp
        for module in self.stages:
            module.routing = None
        return total
