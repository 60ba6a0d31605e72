"""The loss ``hf-tp train`` optimises, defined once for the loop and the estimate."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hf_tp.context.token_share import local_tokens, shift_labels, state_of, sum_over_cp
from hf_tp.core.module_queries import num_experts
from hf_tp.data.steps import StepBatches
from hf_tp.moe.aux_loss import router_aux_term, routing_totals, standard_aux_loss, step_totals
from hf_tp.objectives.base import MicroLoss
from hf_tp.parallel.as_forward import call_as_forward
from hf_tp.parallel.linear_ce import causal_lm_loss
from hf_tp.parallel.loss_parallel import loss_parallel
from hf_tp.pipeline.schedules import stage_cross_entropy


def loss_context(vocab_sharded_logits: bool) -> contextlib.AbstractContextManager:
    """The context the forward and backward run in: :func:`hf_tp.loss_parallel` when the logits
    are sharded over the vocab (``parallelize(..., loss_parallel=True)``), else none."""
    return loss_parallel() if vocab_sharded_logits else contextlib.nullcontext()


def training_loss(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    num_items_in_batch: int,
    fused: bool,
    dp_group: dist.ProcessGroup | None = None,
    aux_weight: float = 1.0,
    routing: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, aux): HF's ``labels=`` loss of one micro-batch divided by the global target count (so
    summing the micro-batches of every rank gives the token mean of the global batch), fused with
    the lm_head when ``fused`` (see :func:`hf_tp.parallel.linear_ce.fusable`); for a MoE model with
    ``output_router_logits``, plus ``router_aux_loss_coef`` times this rank's term of the global
    batch's load-balancing loss (:mod:`hf_tp.moe.aux_loss`) times ``aux_weight``, the
    unweighted term returned as ``aux``. ``routing`` (:func:`step_routing`) makes the term this
    micro-batch's share of the whole step's aux loss; without it the term is over this micro-step's
    rows of every dp rank. A ``row_lengths`` entry (the collator's) is no model input: it marks
    the tp padding, which the aux loss leaves out. With context parallelism ``dp_group`` is the
    dp x cp group (each cp rank routes its own tokens) and both terms come back summed over cp."""
    inputs, mask = _aux_inputs(batch)
    batch = {k: v for k, v in batch.items() if k != "row_lengths"}
    if standard_aux_loss(model):
        config = model.config
        out = model(**inputs, output_router_logits=True, use_cache=False)
        labels = batch["labels"]
        local = {"shift_labels": local_tokens(model, shift_labels(labels))} if state_of(model) else {}
        lm = model.loss_function(out.logits, labels, config.vocab_size, num_items_in_batch=num_items_in_batch, **local)
        aux = router_aux_term(model, out.router_logits, mask, dp_group, routing)
        return sum_over_cp(model, lm) + config.router_aux_loss_coef * aux_weight * aux, aux.detach()
    if fused:
        loss = causal_lm_loss(
            model,
            batch["input_ids"],
            batch.get("attention_mask"),
            batch["labels"],
            num_items_in_batch,
            position_ids=batch.get("position_ids"),
            **{k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "labels", "position_ids")},
        )  # the rest: a multimodal batch's pixel_values and the family's image inputs
        return loss, None
    return model(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss, None


@dataclass
class CrossEntropy:
    """Next-token cross entropy (``--objective sft``) as an :class:`hf_tp.objectives.base.Objective`:
    :func:`training_loss` over the global batch's targets."""

    fused: bool
    route_group: dist.ProcessGroup | None = None
    name: str = "sft"
    metric_names: tuple[str, ...] = ()

    def micro_loss(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        step: StepBatches,
        *,
        aux_weight: float = 1.0,
        routing: torch.Tensor | None = None,
    ) -> MicroLoss:
        loss, aux = training_loss(
            model, batch, step.num_targets, self.fused, self.route_group, aux_weight=aux_weight, routing=routing
        )
        return MicroLoss(loss, aux)

    def staged(self, batch: dict[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
        return batch

    def last_stage_loss(
        self, model: nn.Module, logits: torch.Tensor, batch: dict[str, torch.Tensor], step: StepBatches
    ) -> MicroLoss:
        return MicroLoss(stage_cross_entropy(model, logits, batch["labels"], step.num_targets))


def step_routing(
    model: nn.Module, micro_batches: list[dict[str, torch.Tensor]], dp_group: dist.ProcessGroup | None
) -> torch.Tensor | None:
    """The router's top-k counts and rows over all of a step's micro-batches and dp ranks, for
    :func:`training_loss`'s ``routing`` (None for a model without transformers' aux loss).

    The load-balancing loss multiplies per-expert shares of the whole batch, so under gradient
    accumulation no micro-step knows its factor until every micro-batch is routed. The counts
    carry no gradient: one forward per micro-batch without autograd finds them (a third more
    compute; ``--aux-loss-over micro-batch`` skips it). Routers with random jitter route again
    in the training forward, differently."""
    if not standard_aux_loss(model):
        return None
    config = model.config
    parts = []
    with torch.no_grad():
        for batch in micro_batches:
            inputs, mask = _aux_inputs(batch)
            mask = local_tokens(model, mask) if mask is not None else None
            logits = _router_logits(model, inputs)
            counts, _, rows = routing_totals(logits, num_experts(config), config.num_experts_per_tok, mask)
            parts.append((counts, rows))
    return step_totals(parts, dp_group)


def _router_logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The router logits of one forward of the decoder alone, run as the model's own forward (FSDP2's
    hooks gather its parameters): no vocabulary logits, and none of HF's aux loss, which under
    context parallelism would pair this rank's tokens with the whole rows' mask."""
    if hasattr(model, "get_base_model"):  # a peft wrapper: the model inside is what parallelize sharded
        model = model.get_base_model()
    decoder = model.get_decoder()

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids=None, **rest):
        kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **rest)
        return tuple(decoder(input_ids=input_ids, output_router_logits=True, **kwargs).router_logits)

    rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    return call_as_forward(
        model, forward, inputs["input_ids"], inputs.get("attention_mask"), inputs.get("position_ids"), **rest
    )


def _aux_inputs(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The model inputs (no labels, no ``row_lengths``, no stored reference log-probs) and the mask of real (non-padding) rows."""
    lengths = batch.get("row_lengths")
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "row_lengths", "ref_logps")}
    mask = batch.get("attention_mask")
    if mask is None and lengths is not None:
        width = batch["input_ids"].shape[1]
        mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    return inputs, mask
