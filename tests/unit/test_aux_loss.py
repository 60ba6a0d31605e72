"""The global-batch aux loss: the dp ranks' terms add up to transformers' own aux loss over all
rows, and so do their gradients (with padding rows left out)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from hf_tp.moe.aux_loss import load_balancing_loss
from tests.helpers import run_threaded


def test_dp_terms_sum_to_the_single_device_aux_loss() -> None:
    torch.manual_seed(0)
    layers, rows, experts, k = 3, 12, 6, 2
    logits = [torch.randn(rows, experts, dtype=torch.float64, requires_grad=True) for _ in range(layers)]
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[2, 3:] = 0  # a padded row on the second rank
    want = load_balancing_loss_func(tuple(logits), experts, k, mask)
    want.backward()
    terms, grads = {}, {}

    def rank_fn(rank: int) -> None:
        # rank 0: rows 0-3 (batch row 0); rank 1: rows 4-11 (batch rows 1 and 2)
        part = slice(0, 4) if rank == 0 else slice(4, 12)
        mine = [x.detach()[part].clone().requires_grad_(True) for x in logits]
        term = load_balancing_loss(tuple(mine), experts, k, mask[:1] if rank == 0 else mask[1:], dist.group.WORLD)
        term.backward()
        terms[rank], grads[rank] = term.detach(), [x.grad for x in mine]

    run_threaded(2, rank_fn)
    torch.testing.assert_close(terms[0] + terms[1], want.detach().float(), rtol=1e-6, atol=0)
    for i, x in enumerate(logits):
        torch.testing.assert_close(torch.cat([grads[0][i], grads[1][i]]), x.grad, rtol=1e-5, atol=1e-7)
