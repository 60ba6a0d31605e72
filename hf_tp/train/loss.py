"""The loss ``hf-tp train`` optimises, defined once for the loop and the estimate."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hf_tp.parallel.linear_ce import causal_lm_loss
from hf_tp.parallel.loss import loss_parallel


def loss_context(vocab_sharded_logits: bool) -> contextlib.AbstractContextManager:
    """The context the forward and backward run in: :func:`hf_tp.loss_parallel` when the logits
    are sharded over the vocab (``parallelize(..., loss_parallel=True)``), else none."""
    return loss_parallel() if vocab_sharded_logits else contextlib.nullcontext()


def training_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: int, fused: bool
) -> torch.Tensor:
    """HF's ``labels=`` loss of one micro-batch divided by the global target count (so summing the
    micro-batches of every rank gives the token mean of the global batch), fused with the lm_head
    when ``fused`` (see :func:`hf_tp.parallel.linear_ce.fusable`)."""
    if fused:
        return causal_lm_loss(
            model,
            batch["input_ids"],
            batch.get("attention_mask"),
            batch["labels"],
            num_items_in_batch,
            position_ids=batch.get("position_ids"),
        )
    return model(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss
