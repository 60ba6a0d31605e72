"""Per-sequence log-probabilities of the label tokens, from the lm_head fused in chunks, at any tp.

A preference objective needs ``sum_t log p(label_t)`` of each row, not a token mean: the gradient
reaching each token's logits is then a per-row factor, so the fused cross entropy's trick of
computing the gradients during the forward (one scalar loss) does not apply. Here the forward
keeps, per token, only the label's log-prob and the row's log-sum-exp; the backward projects each
chunk of tokens again and turns ``g_t (onehot - softmax)`` into the input and weight gradients.
No more than one chunk's logits exist at a time, forward or backward.

At tp > 1 the lm_head weight is sharded over the vocab: each rank projects onto its vocab rows,
and one all-gather of two numbers per token (the shard's log-sum-exp and the label's logit on
the rank that owns it) gives every rank the whole row's log-prob, exactly as the fused loss of
:mod:`hf_tp.parallel.linear_ce` does; the vocabulary is never gathered. With context parallelism
each rank scores its own tokens and the per-row sums are added over cp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hf_tp.adapters import get_adapter
from hf_tp.context.token_share import local_tokens, shift_labels, sum_over_cp
from hf_tp.labels import IGNORE_INDEX
from hf_tp.moe.aux_loss import standard_aux_loss
from hf_tp.parallel.as_forward import call_as_forward
from hf_tp.parallel.linear_ce import (
    CHUNK_BYTES,
    VocabShard,
    _accumulate_weight_grad,
    _all_gather_single,
    _grad_in_place,
    _shard_stats,
    _vocab_parallel_inputs,
    fusable,
)


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard | None):
    """Per row: the whole vocabulary's log-sum-exp and the target's logit (ignored rows read
    column 0); ``local`` and ``owned`` locate the target in this shard for the backward."""
    if shard is None:
        local = targets.clamp(min=0)
        owned = torch.ones(local.shape, dtype=torch.float32, device=local.device)
        x = logits.float()
        return torch.logsumexp(x, dim=-1), x.gather(1, local.unsqueeze(1)).squeeze(1), local, owned
    local = targets - shard.offset
    hit = (local >= 0) & (local < logits.shape[1])
    local, owned = torch.where(hit, local, 0), hit.float()
    lse, target = _shard_stats(logits, local, owned)
    gathered = torch.empty((shard.world * 2, logits.shape[0]), dtype=lse.dtype, device=lse.device)
    _all_gather_single(gathered, torch.stack([lse, target]), group=shard.group)
    gathered = gathered.view(shard.world, 2, -1)
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(0), local, owned


class _LinearLogProbs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[label] per token (0 where the label is -100), in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, shard: VocabShard | None):
        out = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        lse_all = torch.zeros_like(out)
        for start in range(0, hidden.shape[0], chunk):
            t = targets[start : start + chunk]
            lse, target, _, _ = _chunk_stats(hidden[start : start + chunk] @ weight.t(), t, shard)
            out[start : start + chunk] = (target - lse) * (t != IGNORE_INDEX)
            lse_all[start : start + chunk] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk, ctx.shard = chunk, shard
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        shard, chunk = ctx.shard, ctx.chunk
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            logits = h @ weight.t()
            if shard is None:
                local, owned = t.clamp(min=0), torch.ones(t.shape, dtype=torch.float32, device=t.device)
            else:
                local = t - shard.offset
                hit = (local >= 0) & (local < logits.shape[1])
                local, owned = torch.where(hit, local, 0), hit.float()
            # d logp / d logits = onehot - softmax: (softmax - onehot) scaled by -g (0 on ignored rows)
            scale = -grad_out[start : start + chunk].float() * (t != IGNORE_INDEX)
            g = _grad_in_place(logits.float(), lse_all[start : start + chunk], local, owned, scale).to(logits.dtype)
            if need_h:
                torch.mm(g, weight, out=grad_h[start : start + chunk])
            if need_w:
                _accumulate_weight_grad(grad_w, g, h)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None


def linear_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None = None
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T).gather(-1, targets)`` (0 where ``targets`` is -100), fp32,
    shaped like ``targets``, without the logits of more than ``chunk_tokens`` tokens at a time.
    ``weight`` may be sharded over the vocab (a DTensor, as :func:`linear_cross_entropy` takes it)."""
    shape = targets.shape
    shard = None
    if isinstance(weight, DTensor):
        hidden, weight, shard = _vocab_parallel_inputs(hidden, weight)
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    chunk = chunk_tokens or max(1, CHUNK_BYTES // (4 * max(1, weight.shape[0])))
    return _LinearLogProbs.apply(hidden, weight, targets, chunk, shard).view(shape)


def log_probs_refusal(model: nn.Module, router_logits: bool = True) -> str | None:
    """Why :func:`sequence_log_probs` cannot score ``model`` (a peft wrapper's base model), or None:
    a biased or soft-capped lm_head, or (``router_logits``) a router aux loss that is not
    transformers' ``load_balancing_loss_func``, which hf_tp could not add as HF does."""
    config = model.config
    if not fusable(model, router_logits=True):
        return f"this {config.model_type} model's lm_head is not a plain projection (a bias or soft-capping)"
    routed = getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", None)
    if router_logits and routed and not standard_aux_loss(model):
        return (
            f"this {config.model_type} model's router aux loss is not transformers' load_balancing_loss_func, "
            "which hf_tp adds to a preference loss: set output_router_logits=False in its config"
        )
    return None


class SequenceLogProbs(NamedTuple):
    """:func:`sequence_log_probs`'s result."""

    logps: torch.Tensor  # per row: the sum of its label tokens' log-probs
    counts: torch.Tensor  # per row: its label tokens
    router_logits: tuple[torch.Tensor, ...] | None = None  # a MoE's, for the aux loss (when asked for)


def sequence_log_probs(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int | None = None, router_logits: bool = False
) -> SequenceLogProbs:
    """The per-row log-probs and label counts of a batch (``input_ids``, ``attention_mask``,
    ``labels``; HF's shift: token i+1 is scored at position i), on a plain or an
    ``hf_tp.parallelize``-d model whose lm_head the loss may be fused with
    (:func:`hf_tp.parallel.linear_ce.fusable`). The decoder runs as the model's own forward (FSDP2's
    hooks gather its parameters as in a normal call). ``router_logits``: also return the router
    logits of a MoE that computes transformers' aux loss (``output_router_logits``), which the
    caller adds (:func:`hf_tp.moe.aux_loss.router_aux_term`); otherwise none are recorded."""
    if hasattr(model, "get_base_model"):  # a peft wrapper: the model inside is what parallelize sharded
        model = model.get_base_model()
    why = log_probs_refusal(model, router_logits)
    if why:
        raise ValueError(f"per-sequence log-probs: {why}")
    routed = bool(getattr(model.config, "output_router_logits", False))  # HF's forward would record the router
    aux = router_logits and standard_aux_loss(model)
    decoder = model.base_model if get_adapter(model.config).language_model else model.get_decoder()
    head = model.get_output_embeddings()
    shifted = shift_labels(batch["labels"])
    counts = (shifted != IGNORE_INDEX).sum(1)
    routing = {"output_router_logits": aux} if routed else {}

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, shifted: torch.Tensor):
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **routing)
        sums = linear_log_probs(out.last_hidden_state, head.weight, local_tokens(model, shifted), chunk_tokens)
        # (copies: under tp the router logits are views, which FSDP2 warns about as root outputs)
        return sums.sum(-1), tuple(r.clone() for r in out.router_logits) if aux else ()

    sums, logits = call_as_forward(model, forward, batch["input_ids"], batch.get("attention_mask"), shifted)
    return SequenceLogProbs(sum_over_cp(model, sums), counts, logits or None)


def logits_log_probs(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> SequenceLogProbs:
    """:func:`sequence_log_probs` from logits a forward already gave (a pipeline's last stage, whose
    HF forward ends in the lm_head): per row the sum of its label tokens' log-probs, in fp32, and
    its label count. ``logits`` are this rank's cp tokens of the rows (summed over cp here), and
    may be sharded over the vocab (a DTensor: gathered whole, the gradient sliced back)."""
    shifted = shift_labels(labels)
    counts = (shifted != IGNORE_INDEX).sum(1)
    targets = local_tokens(model, shifted)
    whole = logits.full_tensor() if isinstance(logits, DTensor) else logits
    flat = whole.reshape(-1, whole.shape[-1]).float()
    tokens = -F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    return SequenceLogProbs(sum_over_cp(model, tokens.view(targets.shape).sum(-1)), counts)
