"""A MoE's router load-balancing (aux) loss over pipeline stages, exactly as one device computes it.

transformers' loss is ``E * sum_e f_e * P_e`` over every layer's routing at once: ``f_e`` the
share of top-k choices (all layers, all rows) that went to expert ``e``, ``P_e`` its router
probability summed over every layer's rows, over the same rows. Both are sums over layers, so each
stage holds a part of them. The counts carry no gradient, so the loss is linear in the probability
sums once the counts are known: with the whole step's counts and rows (all stages, micro-batches
and dp ranks: a no-grad pass through the pipeline first, :func:`route`), each stage's micro-batch
adds ``E * sum_e (counts_e / rows) * (its probability sums_e / rows)``; these terms add up to the
single-device loss and each one's gradient is exactly its share. A stage injects its term's
gradient into its own backward (:class:`SideLoss`): no other stage's value is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hf_tp.context.token_share import local_tokens, state_of
from hf_tp.core.module_queries import num_experts
from hf_tp.moe.aux_loss import routing_totals, step_totals


class SideLoss(torch.autograd.Function):
    """``x`` unchanged; its backward also back-propagates ``term`` (scaled by ``weight``), so a
    stage's own loss term trains with the gradient the schedule sends into its output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, term: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.term_like, ctx.weight = term.detach(), weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full_like(ctx.term_like, ctx.weight), None


def holds_routers(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a stage) holds a module whose output transformers records as router
    logits (a stage of dense layers only has none: its forward must not ask for them, HF's aux
    loss would fail on an empty tuple). True when the model names no such recorder class."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    spec = getattr(decoder, "_can_record_outputs", None) or {}
    target = getattr(spec.get("router_logits"), "target_class", spec.get("router_logits"))
    if not isinstance(target, type):
        return True
    return any(isinstance(m, target) for m in model.modules())


def routing_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The real (non-padding) tokens of a batch: its attention mask, or the rows' lengths the
    collator gives when it pads for tensor parallelism; None when every token is real."""
    mask, lengths = batch.get("attention_mask"), batch.get("row_lengths")
    if mask is None and lengths is not None:
        mask = torch.arange(batch["input_ids"].shape[1], device=lengths.device)[None, :] < lengths[:, None]
    return mask


@dataclass
class StageRouting:
    """How a pipeline's stages routed some rows, as :func:`route` found it: ``totals``,
    ``[counts..., rows]`` of every layer of every stage and dp rank (what
    :meth:`hf_tp.pipeline.schedules.Pipeline.step` takes), and
    ``term``, this rank's share of the rows' unweighted aux loss (its stages' layers, its rows):
    the shares of the pp and dp ranks sum to the single-device aux loss."""

    totals: torch.Tensor
    term: float


def stage_totals(model, router_logits, mask: torch.Tensor | None, device) -> torch.Tensor:
    """``[counts..., probability sums..., rows]`` of one stage's layers over this rank's tokens
    (its cp share of the rows' ``mask``; zeros without routers)."""
    config, experts = model.config, num_experts(model.config)
    logits = tuple(layer for layer in (router_logits or ()) if layer is not None)
    if not logits:
        return torch.zeros(2 * experts + 1, device=device)
    mask = local_tokens(model, mask) if mask is not None else None
    counts, probs, rows = routing_totals(logits, experts, config.num_experts_per_tok, mask)
    probs = probs.full_tensor() if isinstance(probs, DTensor) else probs
    return torch.cat([counts, probs, rows[None]])


def route(pipe, micro_batches: list[dict[str, torch.Tensor]]) -> StageRouting:
    """The :class:`StageRouting` of ``micro_batches`` (this dp rank's; the counts over every dp rank's):
    a forward without autograd through the stages in order (:func:`stage_outputs`; collective
    over the pp and dp groups)."""
    parts = []
    with torch.no_grad():
        for batch in micro_batches:
            mask = routing_mask(batch)
            for module, _, logits in stage_outputs(pipe, batch, output_router_logits=True):
                parts.append(stage_totals(module.model, logits, mask, pipe.device))
    mine = torch.stack(parts).sum(dim=0)
    experts = (mine.numel() - 1) // 2
    counts, probs, rows = mine[:experts], mine[experts:-1], mine[-1:]
    totals = step_totals([(counts, rows[0])], pipe.route_group)  # over dp (x cp)
    dist.all_reduce(totals, group=pipe.group)
    if (cp := state_of(pipe.models[0])) is not None:  # the cp ranks' tokens: the whole rows' share
        dist.all_reduce(probs, group=cp.mesh.get_group())
    term = experts * torch.sum((totals[:-1] / totals[-1]) * (probs / totals[-1]))
    return StageRouting(totals, float(term))


def stage_outputs(pipe, batch: dict[str, torch.Tensor], **kwargs) -> Iterator[tuple]:
    """(stage module, its output, its routers' logits) of each of this rank's stages over ``batch``,
    in stage order: each rank runs its stages as their inputs arrive and sends their hidden states
    on to the next stage's rank (point to point over the pp group; the caller picks autograd or
    not). The last stage's output is the logits. ``kwargs`` go to every stage's forward."""
    me = dist.get_rank(pipe.group)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "row_lengths", "input_ids")}
    x = batch["input_ids"]
    for s in range(pipe.num_stages):
        if pipe.stage_rank(s) != me:
            continue
        if s > 0 and pipe.stage_rank(s - 1) != me:
            x = _receive(pipe, pipe.stage_rank(s - 1))
        module = pipe.stages[pipe.stage_ids.index(s)]
        module.seq_len = batch["input_ids"].shape[1]
        out, logits = module.run(x, **inputs, **kwargs)
        yield module, out, logits
        if s < pipe.num_stages - 1 and pipe.stage_rank(s + 1) != me:
            _send(pipe, out, pipe.stage_rank(s + 1))
        x = out


def _send(pipe, x: torch.Tensor, to: int) -> None:
    peer = dist.get_global_rank(pipe.group, to)
    dist.send_object_list([(tuple(x.shape), x.dtype)], dst=peer, group=pipe.group, device=pipe.device)
    dist.send(x.contiguous(), dst=peer, group=pipe.group)


def _receive(pipe, source: int) -> torch.Tensor:
    peer = dist.get_global_rank(pipe.group, source)
    meta = [None]
    dist.recv_object_list(meta, src=peer, group=pipe.group, device=pipe.device)
    shape, dtype = meta[0]
    x = torch.empty(shape, dtype=dtype, device=pipe.device)
    dist.recv(x, src=peer, group=pipe.group)
    return x
