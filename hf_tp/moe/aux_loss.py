"""The router's load-balancing (aux) loss over the whole global batch, as one device computes it.

transformers adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to the
loss of every forward: Switch Transformer's ``E * sum_e f_e * P_e`` (``f_e``: the share of top-k
choices that went to expert ``e``, ``P_e``: its mean router probability), over the rows of *that*
forward. Under data parallelism each rank would compute it over its own rows, and a mean of such
products is not the product of the means: the curve would depend on the mesh. Here the counts are
summed over the dp ranks first (one small all-reduce, no gradient: top-k choices have none), so
each rank adds ``E * sum_e f_e * (its own probability sum_e / all rows)``: the ranks' terms add up
to the single-device loss, and each rank's gradient is its rows' share of the single-device one.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from hf_tp.context.token_share import local_tokens, sum_over_cp
from hf_tp.core.module_queries import num_experts


def standard_aux_loss(model: nn.Module) -> bool:
    """The model computes transformers' Switch-style aux loss (``load_balancing_loss_func``) when
    ``output_router_logits`` is set, and it is set: then hf_tp computes it over the global batch."""
    config = model.config
    if not getattr(config, "output_router_logits", False) or not getattr(config, "router_aux_loss_coef", None):
        return False
    hf_class = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), None)
    try:
        source = inspect.getsource(hf_class.forward) if hf_class is not None else ""
    except (OSError, TypeError):
        return False
    return "load_balancing_loss_func(" in source and num_experts(config) is not None


def routing_totals(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k choices per expert, router probability sums per expert, rows) of one forward's
    router logits, every layer's rows together as transformers concatenates them, padding rows
    (``attention_mask`` 0) left out. The counts and rows carry no gradient; the sums do."""
    logits = [layer for layer in router_logits if layer is not None]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    rows = torch.zeros((), dtype=torch.float32, device=logits[0].device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(logits[0].device, torch.float32)
    for layer in logits:
        p = torch.softmax(layer.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        weight = torch.ones(p.shape[0], device=p.device) if mask is None else mask
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probs = probs + (p * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return counts.detach(), probs, rows.detach()


def step_totals(
    counts_and_rows: list[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[counts..., rows]`` summed over micro-batches and the dp ranks (one small all-reduce)."""
    totals = torch.stack([torch.cat([c, r[None]]) for c, r in counts_and_rows]).sum(dim=0)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    return totals


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    totals: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's term of the global batch's aux loss (the terms of a dp group sum to it).

    Written out (not transformers' function) because the counts must be summed over the dp ranks
    between the reduction and the product; the formula is transformers' own, every layer's rows
    together, with padding rows left out. ``totals`` (:func:`step_totals`), when given, are the
    whole step's counts and rows over several micro-batches: then the terms of every micro-batch
    and rank sum to the aux loss of the whole global batch, as one device computes it in one
    forward."""
    counts, probs, rows = routing_totals(router_logits, num_experts, top_k, attention_mask)
    if totals is None:
        totals = step_totals([(counts, rows)], group)
    counts, rows = totals[:-1], totals[-1]
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def router_aux_term(
    model: nn.Module,
    router_logits: tuple[torch.Tensor, ...],
    attention_mask: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    totals: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's unweighted term of the global batch's aux loss from one forward's router logits
    (padding rows, ``attention_mask`` 0, left out; this rank's tokens under context parallelism),
    summed over cp: what every objective that trains a MoE's routers adds, times
    ``router_aux_loss_coef``. ``group`` / ``totals``: as :func:`load_balancing_loss`."""
    config = model.config
    mask = local_tokens(model, attention_mask) if attention_mask is not None else None
    aux = load_balancing_loss(router_logits, num_experts(config), config.num_experts_per_tok, mask, group, totals)
    return sum_over_cp(model, aux)
