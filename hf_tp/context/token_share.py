"""Context parallelism: each row's sequence split over a ``cp`` mesh dim, attention exact across it.

Every rank of a cp x tp group is given the same full rows; the model's forward keeps this rank's
share of the tokens (:class:`TokenShare`) and the rest of the model never sees the others. Attention
is the one place tokens meet: each rank all-gathers the keys and values of its cp group (an
autograd all-gather whose backward reduce-scatters dK and dV) and attends its own queries to
them under a mask built from *global* token indices: causal, padding, packed documents
(HF's rule: position_ids that restart, no attention_mask) and sliding windows. This is the
all-gather form of context parallelism (Llama 3's): under grouped-query attention K and V are
a fraction of the hidden width (1/8 for Llama-3.1-70B), so one gather per layer costs less than
ring attention's cp-1 exchanges of the same bytes, and any mask is exact. The causal work is
balanced: the sequence is cut into 2 x cp chunks and rank r keeps chunks r and 2cp-1-r.

The local kernel is the family's own (transformers' SDPA, or the family's eager function where
the model runs eager: soft-capping and attention sinks then work as in HF) given a boolean mask
of (local tokens x all tokens); on CPU SDPA takes it as is. A GPU long-context run would hand the
same predicate to flex attention as a block mask instead of materialising it (not done here: no
GPU was available to test it on).

Labels are shifted over the whole row before it is split (a chunk's last token predicts the next
chunk's first), rotary embeddings see global positions, and a loss comes back as the whole rows'
loss on every cp rank (:func:`sum_over_cp`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hf_tp.compat.torch_distributed import autograd_all_gather
from hf_tp.core.record import facts_of, record_of
from hf_tp.labels import IGNORE_INDEX

ATTENTION_NAME = "hf_tp_cp"
_all_gather = autograd_all_gather()  # the autograd all-gather (backward: reduce-scatter)


@dataclass(frozen=True)
class TokenShare:
    """Which tokens of a row rank ``rank`` of ``cp`` keeps: chunks ``rank`` and ``2cp-1-rank`` of
    ``2cp`` equal chunks (the head of the row and its tail, so every rank has the same causal work)."""

    cp: int
    rank: int

    def indices(self, seq: int, rank: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s (default: this rank's) tokens, in their local order."""
        r = self.rank if rank is None else rank
        c = seq // (2 * self.cp)
        head = torch.arange(r * c, (r + 1) * c, device=device)
        return torch.cat([head, torch.arange((2 * self.cp - 1 - r) * c, (2 * self.cp - r) * c, device=device)])

    def gathered(self, seq: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of the keys an all-gather over cp returns (rank 0's tokens first)."""
        return torch.cat([self.indices(seq, r, device) for r in range(self.cp)])

    def take(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a tensor whose ``dim`` is the whole sequence."""
        if t.shape[dim] == 1:  # broadcast along the sequence (position ids of one row, say)
            return t
        return t.index_select(dim, self.indices(t.shape[dim], device=t.device))


Layout = TokenShare  # its name before the core package (code written against the older docs/long-context.md)


@dataclass
class ContextState:
    """The cp group of a model and what the current forward told its attention (set per call)."""

    mesh: DeviceMesh
    base: str  # the model's own attention implementation ("sdpa", "eager", ...)
    multiple: int  # a row's length must divide by this (2 x cp x tp)
    layout: TokenShare = field(init=False)
    seq: int = 0
    q_index: torch.Tensor | None = None
    k_index: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None  # (B, S) bool, the padding mask
    docs: torch.Tensor | None = None  # (B, S) document ids of packed rows
    masks: dict = field(default_factory=dict)  # this forward's masks, shared by its layers
    called: set = field(default_factory=set)  # ids of the attention modules that ran in this forward
    documents: bool = True  # the family masks packed documents (position_ids restarting) as HF does
    # A pipeline stage after the first is fed this rank's tokens already (the previous stage's
    # output): the rows' whole length, set before its forward (0: the inputs are whole rows).
    stage_seq: int = 0
    # The padding mask a MoE's forward that records router logits was given, held here for the
    # decoder (hf_tp.context.context_install): HF's own aux loss would pair it with this rank's tokens.
    padding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.layout = TokenShare(self.mesh.size(), self.mesh.get_local_rank())

    def start(self, seq: int, attention_mask: torch.Tensor | None, docs: torch.Tensor | None, device) -> None:
        """Record a forward's rows: their length, padding and documents."""
        if seq % self.multiple:
            raise ValueError(
                f"context parallelism splits each row into {self.multiple} equal pieces (2 x cp x tp), so the "
                f"sequence length must be a multiple of {self.multiple}, got {seq}; pad the rows (hf-tp train and "
                f"hf_tp's collator do) or change --seq-len"
            )
        self.seq, self.masks, self.called = seq, {}, set()
        self.q_index = self.layout.indices(seq, device=device)
        self.k_index = self.layout.gathered(seq, device=device)
        self.key_valid = attention_mask.bool() if attention_mask is not None else None
        self.docs = docs

    def mask(self, batch: int, window: int | None, device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(B, 1, local tokens, all tokens): HF's causal mask with padding, documents and
        ``window``, in global indices, keys in all-gather order; bool, or additive in ``dtype``
        (0 where allowed, the dtype's min elsewhere).

        Made once per forward and shared by every layer: SDPA given a bool mask makes an additive
        copy per call and keeps it for backward (4 GiB per layer for a 64k row at cp 2), one
        additive mask handed to all layers is kept once. Dropped at the end of the forward
        (:meth:`finish`); autograd keeps what backward needs."""
        key = (batch, window, dtype)
        if key not in self.masks:
            q, k = self.q_index[:, None], self.k_index[None, :]
            allowed = (k <= q)[None].expand(batch, -1, -1)
            if window is not None:
                allowed = allowed & (k > q - window)[None]
            if self.key_valid is not None:
                allowed = allowed & self.key_valid[:, self.k_index][:, None, :]
            if self.docs is not None:
                docs = self.docs.expand(batch, -1)
                allowed = allowed & (docs[:, self.q_index][:, :, None] == docs[:, self.k_index][:, None, :])
            out = allowed[:, None].to(device)
            if dtype is not None:
                # Queries that may attend to nothing: only padding makes them (a query's own key is
                # allowed otherwise); not tested for any (no data-dependent branch: hf-tp estimate).
                empty = ~out.any(-1)[:, 0, :, None, None] if self.key_valid is not None else None
                self.masks[("empty", batch, window)] = empty
                out = torch.zeros((), dtype=dtype, device=device).masked_fill(~out, torch.finfo(dtype).min)
            self.masks[key] = out
        return self.masks[key]

    def empty_rows(self, batch: int, window: int | None) -> torch.Tensor | None:
        """(B, local tokens, 1, 1) bool of the queries the last additive :meth:`mask` lets attend to
        no key, or None for rows without padding (every query has a key). SDPA given a bool mask
        returns zeros there; an additive mask would give the mean of the values instead."""
        return self.masks.get(("empty", batch, window))

    def finish(self) -> None:
        """After a forward: drop its masks (an activation-checkpointing recompute rebuilds them)."""
        self.masks = {}


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kw):
    """The attention function registered as ``"hf_tp_cp"``: this rank's queries against the
    keys and values of its whole cp group, under the global mask, through the model's own kernel."""
    state: ContextState = facts_of(module).cp
    if attention_mask is not None or kw.get("position_bias") is not None:
        raise ValueError(
            f"context parallelism: {type(module).__name__} passes its own attention mask or position bias, which "
            "hf_tp's cp cannot split; use --cp 1"
        )
    state.called.add(id(module))
    group = state.mesh.get_group()
    key = _all_gather(key.contiguous(), gather_dim=2, group=group)
    value = _all_gather(value.contiguous(), gather_dim=2, group=group)
    window = _window(module, kw)
    mask = state.mask(query.shape[0], window, query.device, dtype=query.dtype)
    kw.pop("is_causal", None)
    if state.base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, weights = sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kw)
        empty = state.empty_rows(query.shape[0], window)
        return (out if empty is None else out.masked_fill(empty, 0)), weights
    return family_eager(module)(module, query, key, value, mask, **kw)  # (eager HF masks additively too)


def _window(module: nn.Module, kw: dict) -> int | None:
    """The sliding window of this call: the ``sliding_window`` the family passes, else the
    module's or config's own (PhiMoE builds a windowed mask for every layer and passes none)."""
    if "sliding_window" in kw:
        window = kw["sliding_window"]
    else:
        window = getattr(module, "sliding_window", getattr(getattr(module, "config", None), "sliding_window", None))
    return window or None  # Qwen2-MoE writes 0 for "no window"


def family_eager(module: nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward; context parallelism cannot run it")
    return fn


class _SumOverCP(torch.autograd.Function):
    """Forward: the sum of the cp ranks' partial losses (the whole rows' loss, on every rank).
    Backward: cp x the incoming gradient, because FSDP2 then averages gradients over dp x cp where
    the cp ranks' shares must add up."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
        ctx.cp = cp
        out = loss.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.cp, None, None


def state_of(model: nn.Module) -> ContextState | None:
    """The context-parallel state of a model (or of its decoder), or None when it is not context parallel."""
    record = record_of(model)
    if record is not None:
        return record.cp
    found = facts_of(model)
    return None if found is None else found.cp


def sum_over_cp(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """This rank's part of a loss -> the whole rows' loss (identity without context parallelism)."""
    state = state_of(model)
    if state is None:
        return loss
    local = loss.to_local() if hasattr(loss, "to_local") else loss
    return _SumOverCP.apply(local, state.mesh.get_group(), state.mesh.size())


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position i is scored on token i+1, the last on nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def local_tokens(model: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of a (B, S, ...) tensor (the tensor itself without context parallelism)."""
    state = state_of(model)
    return t if state is None else state.layout.take(t)
