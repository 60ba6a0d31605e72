"""Held-out loss of a parallelized model, computed exactly as the training loop computes it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hf_tp.context.token_share import local_tokens, shift_labels, state_of
from hf_tp.labels import count_targets
from hf_tp.moe.pipeline_aux import stage_outputs
from hf_tp.parallel.generate import check_same_on_tp, comm_device, eval_mode, model_meshes, replicated_logits
from hf_tp.parallel.linear_ce import causal_lm_loss, fusable
from hf_tp.parallel.loss_parallel import loss_parallel as _loss_parallel

__all__ = ["EvalResult", "count_targets", "evaluate", "evaluate_pipeline"]

_FUSED_KEYS = {"input_ids", "attention_mask", "labels", "position_ids"}


@dataclass(frozen=True)
class EvalResult:
    """Token-mean loss over every target token of the evaluation (all dp ranks together)."""

    loss: float
    perplexity: float
    tokens: int  # target tokens: labels != IGNORE_INDEX after HF's one-token shift (hf_tp.labels)


def _dp_total(dp_mesh: DeviceMesh, tokens: int, num_batches: int) -> int:
    """Sum the dp ranks' target counts; they must run the same number of forwards (FSDP2)."""
    return _summed_over(dp_mesh.get_group(), comm_device(dp_mesh), tokens, num_batches)


def _summed_over(group: dist.ProcessGroup, device: torch.device, tokens: int, num_batches: int) -> int:
    mine = torch.tensor([tokens, num_batches], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    counts = {int(g[1]) for g in gathered}
    if len(counts) > 1:
        raise ValueError(f"every dp rank must evaluate the same number of batches, got {sorted(counts)}")
    return int(sum(int(g[0]) for g in gathered))


def evaluate(
    model: nn.Module, batches: Iterable[Mapping[str, Any]], *, loss_parallel: bool = True, fused: bool = True
) -> EvalResult:
    """Token-mean cross entropy of ``model`` over ``batches`` (dicts of input_ids, attention_mask,
    labels with -100 where no loss is taken), under ``torch.no_grad`` and eval mode; a MoE's
    router aux loss is not included.

    As in training, each batch's HF loss is a sum over its target tokens divided by the total
    count of the whole evaluation (``num_items_in_batch``), so the result is the mean over all
    tokens, not a mean of batch means, and equals plain HF on the same batches. Call it on every
    rank; the ranks of a tp group must pass the same batches (checked), dp ranks their own rows
    (the same number of batches each; the result covers all of them). ``loss_parallel=True``
    computes the loss on vocab-sharded logits; ``False`` all-gathers them first (same value, more
    memory). With ``fused`` (default), models whose adapter allows it skip the logits altogether
    (:func:`hf_tp.causal_lm_loss`, for batches of input_ids, attention_mask and labels only). The
    model's training flags are restored on return.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    if any("labels" not in b for b in batches):
        raise ValueError("every evaluation batch needs 'labels' (-100 where no loss is taken)")
    device = next(model.parameters()).device
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    dp_mesh, tp_mesh = model_meshes(model)
    if tp_mesh is not None and tp_mesh.size() > 1:
        tensors = [b[k] for b in batches for k in sorted(b) if torch.is_tensor(b[k])]
        check_same_on_tp(tp_mesh, tensors, "evaluation batches")
    tokens = sum(count_targets(b["labels"]) for b in batches)
    if dp_mesh is not None and dp_mesh.size() > 1:
        tokens = _dp_total(dp_mesh, tokens, len(batches))
    if tokens == 0:
        raise ValueError("the evaluation batches hold no target tokens (every shifted label is -100)")

    # A MoE's router aux loss is a training regulariser over each forward's rows (per dp rank,
    # per batch): left out, the result is the cross entropy alone, the same on every mesh, and
    # its perplexity is one.
    no_aux = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
    can_fuse = fusable(model)
    ctx = _loss_parallel() if loss_parallel else replicated_logits(model)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad(), eval_mode(model), ctx:
        for b in batches:
            if fused and can_fuse and set(b) <= _FUSED_KEYS:
                loss = causal_lm_loss(
                    model, b["input_ids"], b.get("attention_mask"), b["labels"], tokens, b.get("position_ids")
                )
            else:
                loss = model(**b, num_items_in_batch=tokens, use_cache=False, **no_aux).loss
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).double()
    if dp_mesh is not None and dp_mesh.size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_mesh.get_group())
    value = total.item()
    return EvalResult(loss=value, perplexity=math.exp(value) if value < 700 else math.inf, tokens=tokens)


def evaluate_pipeline(pipe, batches: Iterable[Mapping[str, Any]]) -> EvalResult:
    """:func:`evaluate` of a pipeline-parallel model (a :class:`hf_tp.pipeline.schedules.Pipeline`;
    call on every rank, each dp rank with its own rows): each batch's hidden states pass through
    the stages without autograd (:func:`hf_tp.moe.pipeline_aux.stage_outputs`), the last
    stage takes HF's cross entropy of its logits over the whole evaluation's target count (under
    tp on the vocab shards), and the sum over the pp and dp ranks is the token-mean loss, as at
    pp 1. A MoE's router aux loss is left out, as :func:`evaluate` leaves it."""
    batches = [{k: v.to(pipe.device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    if not batches or any("labels" not in b for b in batches):
        raise ValueError("evaluate needs at least one batch, each with 'labels' (-100 where no loss is taken)")
    tokens = sum(count_targets(b["labels"]) for b in batches)
    if pipe.route_group is not None and dist.get_world_size(pipe.route_group) > 1:
        # the stages' dp group, dp x cp under context parallelism, whose cp ranks hold the same rows
        cp = state_of(pipe.models[0])
        tokens = _summed_over(pipe.route_group, pipe.device, tokens, len(batches)) // (cp.mesh.size() if cp else 1)
    if tokens == 0:
        raise ValueError("the evaluation batches hold no target tokens (every shifted label is -100)")
    last = pipe.models[-1]
    vocab = last.config.get_text_config().vocab_size
    no_aux = {"output_router_logits": False} if getattr(last.config, "output_router_logits", False) else {}
    total = torch.zeros((), dtype=torch.float64, device=pipe.device)
    with torch.no_grad(), contextlib.ExitStack() as modes, _loss_parallel():
        for model in pipe.models:
            modes.enter_context(eval_mode(model))
        for b in batches:
            for module, logits, _ in stage_outputs(pipe, b, **no_aux):
                if module.last:  # (under cp: this rank's tokens' targets, summed over the cp ranks below)
                    shifted = local_tokens(module.model, shift_labels(b["labels"])).contiguous()
                    loss = module.model.loss_function(
                        logits, None, vocab, num_items_in_batch=tokens, shift_labels=shifted
                    )
                    total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).double()
    for group in (pipe.group, pipe.route_group):
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    value = total.item()
    return EvalResult(loss=value, perplexity=math.exp(value) if value < 700 else math.inf, tokens=tokens)
