"""The lm_head and the cross entropy fused, in chunks of tokens, for models whose vocab is not
sharded (tp=1).

HF computes ``logits = lm_head(h)`` for every token, upcasts them to fp32 and takes the cross
entropy; autograd then keeps the logits, their fp32 copy and the softmax for backward. With a
large vocabulary that is most of a small model's memory (Qwen2-0.5B, 16k tokens: 2.5G logits,
about 35 GB) and a long run of memory-bound kernels. Here each chunk of tokens is projected,
reduced to its loss and turned into its input and weight gradients at once, so only one chunk's
logits ever exist. The arithmetic is HF's: logits in the compute dtype upcast to fp32, sum over
the targets divided by ``num_items_in_batch`` (or the target count), the gradient
``softmax - onehot``; fp32 results match HF to round-off.

At tp > 1 with loss parallel, the logits are already sharded over the vocab and torch's
``loss_parallel`` computes the loss on the shards, so this path is not used there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100
CHUNK_BYTES = 2**29  # fp32 logits of one chunk: 512 MiB


def _chunk_step(logits: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor, need_grad: bool):
    """One chunk's loss (sum over its targets) and, if asked, d loss / d logits in the logits'
    dtype. ``row_scale`` is 1/divisor on target rows, 0 on ignored ones (a tensor, so a compiled
    version is not recompiled for each step's divisor)."""
    x = logits.float()  # as HF: lm_head output in the compute dtype, upcast
    lse = torch.logsumexp(x, dim=-1)
    safe = targets.clamp(min=0).unsqueeze(1)  # ignored rows (-100) read column 0, then weigh 0
    loss_sum = ((lse - x.gather(1, safe).squeeze(1)) * (row_scale != 0)).sum()
    if not need_grad:
        return loss_sum, None
    onehot = torch.zeros_like(x).scatter_(1, safe, 1.0)
    g = ((x - lse.unsqueeze(1)).exp() - onehot) * row_scale.unsqueeze(1)  # (softmax - onehot) / divisor
    return loss_sum, g.to(logits.dtype)


# On GPUs the chunk's elementwise work is memory-bound; compiled, it reads the logits once for
# the loss and once for the gradient instead of ~10 passes over an fp32 copy. (CPU runs stay
# eager: compiling costs more there than it saves, and tests see many shapes.)
_chunk_step_compiled = torch.compile(_chunk_step, dynamic=True)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over targets of CE(hidden @ weight.T) / divisor; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, divisor: float, chunk: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_grad = need_h or need_w
        step = _chunk_step_compiled if hidden.is_cuda else _chunk_step
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            t = targets[start : start + chunk]
            row_scale = (t != IGNORE_INDEX).float() / divisor
            loss_sum, g = step(h @ weight.t(), t, row_scale, need_grad)
            total += loss_sum
            if need_h:
                torch.mm(g, weight, out=grad_h[start : start + chunk])
            if need_w:
                grad_w += (g.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: int | float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction="sum") / n``
    without materialising the logits of more than ``chunk_tokens`` tokens at a time.

    ``hidden`` is (tokens, hidden), ``weight`` (vocab, hidden), ``targets`` (tokens,); ``n`` is
    ``num_items_in_batch`` or else the number of targets that are not -100 (HF's convention).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"linear_cross_entropy expects hidden (N, H), weight (V, H), targets (N,); got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    divisor = float(num_items_in_batch) if num_items_in_batch is not None else float((targets != IGNORE_INDEX).sum())
    chunk = chunk_tokens or max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden, weight, targets, divisor, chunk)


def fusable(model: nn.Module, plain_lm_head: bool) -> bool:
    """True when the loss may be fused with the lm_head: the adapter says the logits are a plain
    projection and the head's weight is not sharded over tp (no DTensor inside the forward)."""
    head = model.get_output_embeddings()
    return plain_lm_head and head is not None and getattr(head, "bias", None) is None and not _tp_sharded(head.weight)


def _tp_sharded(weight: torch.Tensor) -> bool:
    # Under FSDP2 alone (tp=1) the weight is a DTensor on the mesh dim named "dp"; any other mesh
    # dim of more than one rank shards it over tp (or something hf_tp did not build).
    if not isinstance(weight, DTensor):
        return False
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    return any(name != "dp" and size > 1 for name, size in zip(names, mesh.shape, strict=True))


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch: int | None = None,
) -> torch.Tensor:
    """HF's causal-LM training loss (labels shifted by one inside) through the fused lm_head + loss.

    The decoder and the loss run as the model's own forward (so FSDP2's hooks on the root module
    gather and free its parameters as in a normal call); the model's ``forward`` is restored after.
    Call only where :func:`fusable` holds.
    """
    decoder = model.get_decoder()
    head = model.get_output_embeddings()

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor) -> torch.Tensor:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # HF: position i predicts token i+1
        return linear_cross_entropy(hidden.flatten(0, 1), head.weight, shifted.flatten(), num_items_in_batch)

    # An instance attribute; nn.Module.__call__ runs the hooks around it. The tensors go through
    # the call (FSDP2's root hook moves its inputs to the device and expects at least one).
    model.forward = forward
    try:
        return model(input_ids, attention_mask, labels)
    finally:
        del model.forward


def training_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], num_items_in_batch: int, fused: bool
) -> torch.Tensor:
    """The loss ``hf-tp train`` optimises for one micro-batch: HF's ``labels=`` loss divided by the
    global target count, fused with the lm_head when ``fused`` (see :func:`fusable`)."""
    if fused:
        return causal_lm_loss(
            model, batch["input_ids"], batch.get("attention_mask"), batch["labels"], num_items_in_batch
        )
    return model(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss
