"""Dropout whose masks are right under tensor parallelism (the role of Megatron's RNG tracker).

A mask must be the same on every rank that holds the same values and different where ranks hold
different values: equal over tp where the dropped tensor is replicated over tp (the input of a
column-parallel LoRA branch: the gathered sequence), distinct where it is sharded (sequence
shards, the feature shards a row-parallel LoRA branch reads) and distinct over dp (other rows).
Each :class:`ShardAwareDropout` draws from its own generator, seeded from the process's initial
seed, the module's index and the ranks that share its tensor: the first global rank of the tp
group when the tensor is replicated over tp, the rank's own global rank otherwise. No collective
is involved and the streams do not depend on how other random ops consumed torch's default
generator (which uneven shards make rank-dependent). Each call's mask is keyed by its call count;
under activation checkpointing the recompute replays the forward's keys.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_tp.compat.torch_internals import in_autograd_backward

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index, rank) over the seed space


def stream_seed(base: int, index: int, rank: int) -> int:
    """A generator seed for the stream of (base seed, module index, owner rank); distinct inputs
    give distinct seeds with overwhelming probability."""
    h = (base * _MIX + index) % 2**64
    h = (h * _MIX + rank + 1) % 2**64
    return h % 2**63


class ShardAwareDropout(nn.Module):
    """``nn.Dropout(p)`` drawing its mask from a stream chosen by the input's placement.

    A ``DTensor`` input replicated on every mesh dim (tp) uses the stream of its tp group (same
    mask on every rank of the group); any other input (sharded DTensor, plain tensor) the stream
    of this rank. The mask enters as a ``DTensor`` with the input's placements, so the product's
    gradient keeps the input gradient's placement (no collective)."""

    def __init__(self, p: float, index: int, base_seed: int | None = None, owner: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.index = index
        self.fixed_owner = owner  # the stream's owner whatever the input (a whole-run region's tp group)
        self.base_seed = torch.initial_seed() if base_seed is None else base_seed
        self.calls = 0  # masks drawn so far: each call's key
        self.checkpointed = False  # set under activation checkpointing: keys kept for the recompute
        self._replay: collections.deque[int] = collections.deque()

    def extra_repr(self) -> str:
        return f"p={self.p}, index={self.index}"

    def owner(self, x: torch.Tensor) -> int:
        """The global rank that names the stream ``x`` draws from (see the module docstring)."""
        if self.fixed_owner is not None:
            return self.fixed_owner
        if isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements):
            return int(x.device_mesh.mesh.flatten()[0])
        return dist.get_rank() if dist.is_initialized() else 0

    def generator(self, x: torch.Tensor) -> torch.Generator:
        """This call's generator: seeded from the stream's owner and the call's key (the next one,
        or inside an activation-checkpointing recompute, which runs in the backward, the key its
        forward used: the recompute redraws the forward's mask)."""
        if in_autograd_backward() and self._replay:
            key = self._replay.popleft()
        else:
            key, self.calls = self.calls, self.calls + 1
            if self.checkpointed and torch.is_grad_enabled():
                self._replay.append(key)
        device = x.device if not isinstance(x, DTensor) else x.to_local().device
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(stream_seed(self.base_seed, self.index, self.owner(x)), key, 0))
        return gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        gen = self.generator(x)
        local = x.to_local() if isinstance(x, DTensor) else x
        keep = torch.empty_like(local).bernoulli_(1.0 - self.p, generator=gen).div_(1.0 - self.p)
        if isinstance(x, DTensor):
            keep = DTensor.from_local(keep, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
        return x * keep
