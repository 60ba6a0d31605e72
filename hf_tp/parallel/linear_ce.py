"""The lm_head and the cross entropy fused, in chunks of tokens, at any tp.

HF computes ``logits = lm_head(h)`` for every token, upcasts them to fp32 and takes the cross
entropy; autograd then keeps the logits, their fp32 copy and the softmax for backward. With a
large vocabulary that is most of a small model's memory (Qwen2-0.5B, 16k tokens: 2.5G logits,
about 35 GB) and a long run of memory-bound kernels. Here each chunk of tokens is projected,
reduced to its loss and turned into its input and weight gradients at once, so only one chunk's
logits ever exist. The arithmetic is HF's: logits in the compute dtype upcast to fp32, sum over
the targets divided by ``num_items_in_batch`` (or the target count), the gradient
``softmax - onehot``; fp32 results match HF to round-off.

At tp > 1 the lm_head weight is sharded over the vocab (``ColwiseParallel``): each rank projects
the gathered hidden states onto its vocab rows only, and one all-gather of two numbers per token
(the shard's log-sum-exp and, on the rank that owns it, the target's logit) gives every rank the
whole row's loss. The input gradient is a partial sum over the vocab shards, reduce-scattered
back to the sequence-sharded layout by DTensor in backward, exactly what ``ColwiseParallel``'s own
backward would do. torch's ``loss_parallel`` (the path without fusion) keeps the b*s*V/tp logits,
their fp32 copy and the softmax alive instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from hf_tp.adapters import get_adapter
from hf_tp.context.token_share import local_tokens, shift_labels, sum_over_cp
from hf_tp.labels import IGNORE_INDEX
from hf_tp.parallel.as_forward import call_as_forward

CHUNK_BYTES = 2**29  # fp32 logits of one chunk: 512 MiB


def _grad_in_place(x: torch.Tensor, lse: torch.Tensor, cols: torch.Tensor, hit: torch.Tensor, row_scale: torch.Tensor):
    """(softmax - onehot) * row_scale, written over the fp32 logits ``x``; ``hit`` (1.0/0.0) is
    where the one-hot's 1 is at column ``cols``. In place, so an eager chunk holds one fp32 copy
    of its logits rather than five (the compiled version fuses it either way)."""
    x.sub_(lse.unsqueeze(1)).exp_()
    x.scatter_add_(1, cols.unsqueeze(1), -hit.unsqueeze(1))
    return x.mul_(row_scale.unsqueeze(1))


def _chunk_step(logits: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor, need_grad: bool):
    """One chunk's loss (sum over its targets) and, if asked, d loss / d logits in the logits'
    dtype. ``row_scale`` is 1/divisor on target rows, 0 on ignored ones (a tensor, so a compiled
    version is not recompiled for each step's divisor). Overwrites fp32 ``logits``."""
    x = logits.float()  # as HF: lm_head output in the compute dtype, upcast
    lse = torch.logsumexp(x, dim=-1)
    safe = targets.clamp(min=0)  # ignored rows (-100) read column 0, then weigh 0
    loss_sum = ((lse - x.gather(1, safe.unsqueeze(1)).squeeze(1)) * (row_scale != 0)).sum()
    if not need_grad:
        return loss_sum, None
    return loss_sum, _grad_in_place(x, lse, safe, torch.ones_like(lse), row_scale).to(logits.dtype)


def _shard_stats(logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor):
    """Per row, this vocab shard's log-sum-exp and the target's logit where the shard owns the
    target (0 elsewhere); ``owned`` is 1.0/0.0."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    return lse, x.gather(1, local_targets.unsqueeze(1)).squeeze(1) * owned


def _shard_grad(
    logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor
) -> torch.Tensor:
    """This shard's columns of (softmax - onehot) / divisor, given the whole row's ``lse``.
    Overwrites fp32 ``logits``."""
    return _grad_in_place(logits.float(), lse, local_targets, owned, row_scale).to(logits.dtype)


# On GPUs the chunk's elementwise work is memory-bound; compiled, it reads the logits once for
# the loss and once for the gradient instead of ~10 passes over an fp32 copy. (CPU runs stay
# eager: compiling costs more there than it saves, and tests see many shapes.) Default dynamic
# shapes: the full chunks get a kernel specialised to their sizes, and only a dimension that
# changes (the last chunk's rows) is made dynamic on recompilation, which is faster than
# dynamic=True (timings: docs/benchmarks.md, scripts/bench_fused_loss.py).
class _CompiledOnFirstCall:
    """``torch.compile(fn)``, made at the first call. Compiling at import would load inductor in
    every process that imports hf_tp (about 1.5 s of CPU start-up per rank) though CPU runs never
    call it."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = torch.compile(self.fn)
        return self._compiled(*args, **kwargs)


_chunk_step_compiled = _CompiledOnFirstCall(_chunk_step)
_shard_stats_compiled = _CompiledOnFirstCall(_shard_stats)
_shard_grad_compiled = _CompiledOnFirstCall(_shard_grad)


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[offset, offset + size)`` of a weight sharded over the vocab across
    ``group`` (``world`` ranks)."""

    group: dist.ProcessGroup
    world: int
    offset: int


def _sharded_chunk_step(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_scale: torch.Tensor,
    need_grad: bool,
    shard: VocabShard,
    compiled: bool,
):
    """:func:`_chunk_step` on one vocab shard of the logits; one all-gather per chunk."""
    local = targets - shard.offset
    owned = (local >= 0) & (local < logits.shape[1])  # -100 and other shards' targets: not owned
    local = torch.where(owned, local, 0)
    owned = owned.float()
    stats_fn, grad_fn = (_shard_stats_compiled, _shard_grad_compiled) if compiled else (_shard_stats, _shard_grad)
    lse, target_logit = stats_fn(logits, local, owned)
    # Stacked along dim 0 as gloo requires ((world * 2, n), not (world, 2, n)), then viewed per rank.
    gathered = torch.empty((shard.world * 2, logits.shape[0]), dtype=lse.dtype, device=lse.device)
    _all_gather_single(gathered, torch.stack([lse, target_logit]), group=shard.group)
    gathered = gathered.view(shard.world, 2, -1)
    lse = torch.logsumexp(gathered[:, 0], dim=0)  # the whole row's, from the shards' (exact algebra)
    loss_sum = ((lse - gathered[:, 1].sum(0)) * (row_scale != 0)).sum()
    if not need_grad:
        return loss_sum, None
    return loss_sum, grad_fn(logits, local, owned, lse, row_scale)


def _accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += g.T @ h`` inside the GEMM (beta=1), fp32 ``grad_w`` and bf16 ``g``, ``h`` too.

    A bf16 product cast to fp32 and then added is three more passes over a vocab x hidden fp32
    matrix per chunk; the GEMM's epilogue does it in place (timings: docs/benchmarks.md). Mixed
    dtypes need ``addmm(out_dtype=)`` (CUDA only).
    """
    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.t(), h)
        return
    if grad_w.is_cuda:
        try:
            torch.addmm(grad_w, g.t(), h, out_dtype=grad_w.dtype, out=grad_w)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without the mixed-dtype GEMM
            pass
    grad_w += (g.t() @ h).float()


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over targets of CE(hidden @ weight.T) / divisor; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, divisor: float, chunk: int, shard: VocabShard | None):
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
            if shard is None:
                loss_sum, g = step(h @ weight.t(), t, row_scale, need_grad)
            else:
                loss_sum, g = _sharded_chunk_step(h @ weight.t(), t, row_scale, need_grad, shard, hidden.is_cuda)
            total += loss_sum
            if need_h:
                torch.mm(g, weight, out=grad_h[start : start + chunk])
            if need_w:
                _accumulate_weight_grad(grad_w, g, h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    num_items_in_batch: int | float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction="sum") / n``
    without materialising the logits of more than ``chunk_tokens`` tokens at a time.

    ``hidden`` is (..., H), ``weight`` (V, H), ``targets`` (...); ``n`` is ``num_items_in_batch``
    or else the number of targets that are not -100 (HF's convention). Under tensor parallelism
    ``weight`` is a DTensor sharded over the vocab (``Shard(0)`` on a 1-D mesh, as
    ``ColwiseParallel`` leaves it) and ``hidden`` a DTensor on that mesh (sequence-sharded, say)
    or a plain tensor replicated over it; the loss is then a plain tensor, equal on every rank.
    """
    if weight.dim() != 2 or targets.shape != hidden.shape[:-1] or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy expects hidden (..., H), weight (V, H), targets (...); got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    shard = None
    if isinstance(weight, DTensor):
        hidden, weight, shard = _vocab_parallel_inputs(hidden, weight)
    elif isinstance(hidden, DTensor):
        raise ValueError(
            "linear_cross_entropy got a DTensor hidden with a plain weight; shard the weight over the vocab"
        )
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    divisor = float(num_items_in_batch) if num_items_in_batch is not None else float((targets != IGNORE_INDEX).sum())
    chunk = chunk_tokens or max(1, CHUNK_BYTES // (4 * max(1, weight.shape[0])))
    return _LinearCrossEntropy.apply(hidden, weight, targets, divisor, chunk, shard)


def _vocab_parallel_inputs(hidden: torch.Tensor, weight: DTensor) -> tuple[torch.Tensor, torch.Tensor, VocabShard]:
    """Local tensors for the sharded path: every token's hidden state, this rank's vocab rows."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise ValueError(
            f"linear_cross_entropy expects a weight sharded over the vocab (Shard(0) on a 1-D mesh), "
            f"got {weight.placements} on a {mesh.ndim}-D mesh"
        )
    if isinstance(hidden, DTensor):
        if hidden.device_mesh != mesh:
            raise ValueError("linear_cross_entropy: hidden and weight are DTensors on different meshes")
        full = hidden.redistribute(mesh, [Replicate()])  # SP: the all-gather ColwiseParallel would do
    else:
        full = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Each rank's input gradient covers its vocab rows only: a partial sum, which DTensor turns
    # back into hidden's layout in backward (a reduce-scatter for a sequence-sharded hidden).
    local_hidden = full.to_local(grad_placements=[Partial()])
    world, rank, vocab = mesh.size(), mesh.get_local_rank(), weight.shape[0]
    rows = -(-vocab // world)  # Shard(0) splits like torch.chunk: ceil(V / world) rows per rank
    offset = min(rank * rows, vocab)
    local_weight = weight.to_local()
    if local_weight.shape[0] != min(vocab, offset + rows) - offset:
        raise ValueError(f"unexpected vocab shard: {local_weight.shape[0]} rows at offset {offset} of {vocab}")
    return local_hidden, local_weight, VocabShard(group=mesh.get_group(), world=world, offset=offset)


def fusable(model: nn.Module, router_logits: bool = False) -> bool:
    """True when the loss may be fused with the lm_head: the model's adapter says the logits are a
    plain projection (``plain_lm_head``: no scaling) and the config has no
    ``final_logit_softcapping`` nor ``output_router_logits`` (a MoE's aux loss), the head has no bias, and its weight is either not sharded over
    tp or sharded over the vocab (``ColwiseParallel``). ``router_logits``: the caller adds the aux
    loss itself from the decoder's router logits, so ``output_router_logits`` is no obstacle."""
    head = model.get_output_embeddings()
    if not get_adapter(model.config).plain_lm_head or head is None or getattr(head, "bias", None) is not None:
        return False
    if getattr(model.config, "final_logit_softcapping", None) is not None:  # Gemma 2: tanh-capped logits
        return False
    if (
        getattr(model.config, "output_router_logits", False) and not router_logits
    ):  # the MoE aux loss comes from HF's forward
        return False
    return all(placement.is_shard(0) for placement in _tp_placements(head.weight))


def _tp_placements(weight: torch.Tensor) -> list:
    # FSDP2 shards the weight on the mesh dim named "dp" ("dp_cp", dp x cp flattened, with context
    # parallelism: a _StridedShard there under tp; "dp_replicate" and "dp_shard" with HSDP); any other mesh dim of more than one rank shards
    # it over tp (or something hf_tp did not build).
    if not isinstance(weight, DTensor):
        return []
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    return [
        pl
        for name, size, pl in zip(names, mesh.shape, weight.placements, strict=True)
        if name not in ("dp", "dp_cp", "dp_replicate", "dp_shard") and size > 1
    ]


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch: int | None = None,
    position_ids: torch.Tensor | None = None,
    **images: torch.Tensor,
) -> torch.Tensor:
    """``model(input_ids, attention_mask=..., labels=labels, position_ids=...).loss`` without the logits: HF's causal-LM
    loss (labels shifted by one inside, -100 ignored, sum / ``num_items_in_batch`` or the target
    count) through the fused lm_head + loss, on a plain or an ``hf_tp.parallelize``-d model.
    Inside a ``loss_parallel`` context or not; call ``backward()`` on the result as usual.

    The decoder and the loss run as the model's own forward (so FSDP2's hooks on the root module
    gather and free its parameters as in a normal call); the model's ``forward`` is restored after.
    With context parallelism (full rows on every cp rank) each rank scores its own tokens and the
    result is the whole rows' loss (:mod:`hf_tp.context.token_share`). ``images``: a multimodal
    wrapper's image inputs (``pixel_values``, ``image_grid_thw``, ...), passed to its base model.
    """
    if not fusable(model):
        raise ValueError(
            f"hf_tp.causal_lm_loss cannot fuse this {model.config.model_type} model's lm_head with the loss "
            "(its adapter does not declare plain_lm_head, or the lm_head has a bias or another sharding); "
            "use model(..., labels=labels).loss"
        )
    # A multimodal wrapper's hidden states come from its base model (which embeds the tokens and
    # builds the masks as the wrapper's own forward does), not from the language model alone.
    decoder = model.base_model if get_adapter(model.config).language_model else model.get_decoder()
    head = model.get_output_embeddings()

    def forward(
        input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor, position_ids=None, **images
    ) -> torch.Tensor:
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **images
        ).last_hidden_state
        shifted = shift_labels(labels)  # HF: position i predicts token i+1, over the whole row
        count = num_items_in_batch if num_items_in_batch is not None else (shifted != IGNORE_INDEX).sum().item()
        return linear_cross_entropy(hidden, head.weight, local_tokens(model, shifted), count)

    return sum_over_cp(
        model, call_as_forward(model, forward, input_ids, attention_mask, labels, position_ids, **images)
    )
