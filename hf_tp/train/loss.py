"""The loss ``hf-tp train`` optimises, defined once for the loop and the estimate."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from hf_tp.adapters.inspect_moe import num_experts
from hf_tp.parallel.aux_loss import load_balancing_loss, standard_aux_loss
from hf_tp.parallel.linear_ce import causal_lm_loss
from hf_tp.parallel.loss import loss_parallel


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, aux): HF's ``labels=`` loss of one micro-batch divided by the global target count (so
    summing the micro-batches of every rank gives the token mean of the global batch), fused with
    the lm_head when ``fused`` (see :func:`hf_tp.parallel.linear_ce.fusable`); for a MoE model with
    ``output_router_logits``, plus ``router_aux_loss_coef`` times this rank's term of the global
    batch's load-balancing loss (:mod:`hf_tp.parallel.aux_loss`) times ``aux_weight`` (1/grad_accum),
    the unweighted term returned as ``aux``. A ``row_lengths`` entry (the collator's) is no model
    input: it marks the tp padding, which the aux loss leaves out."""
    lengths = batch.get("row_lengths")
    batch = {k: v for k, v in batch.items() if k != "row_lengths"}
    if standard_aux_loss(model):
        config = model.config
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = model(**inputs, output_router_logits=True, use_cache=False)
        lm = model.loss_function(out.logits, batch["labels"], config.vocab_size, num_items_in_batch=num_items_in_batch)
        experts = num_experts(config)
        mask = batch.get("attention_mask")
        if mask is None and lengths is not None:
            width = batch["input_ids"].shape[1]
            mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        aux = load_balancing_loss(out.router_logits, experts, config.num_experts_per_tok, mask, dp_group)
        return lm + config.router_aux_loss_coef * aux_weight * aux, aux.detach()
    if fused:
        loss = causal_lm_loss(
            model,
            batch["input_ids"],
            batch.get("attention_mask"),
            batch["labels"],
            num_items_in_batch,
            position_ids=batch.get("position_ids"),
        )
        return loss, None
    return model(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss, None
