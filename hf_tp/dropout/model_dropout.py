"""A model's own dropout (attention, residual, embedding dropout in its config) right under tp.

The masks must be equal on the ranks that hold the same values and distinct elsewhere (the role
of Megatron's RNG tracker): equal over tp where the dropped tensor is replicated over tp (the
residual stream without sequence parallelism, the gathered input of a MoE or whole-run region),
distinct where it is sharded (head-sharded attention probabilities, the sequence-sharded residual
stream, a row-parallel projection's input features), and distinct over dp (other rows).

While a model with :class:`ModelDropout` installed runs forward, ``F.dropout`` and
``F.scaled_dot_product_attention`` (with ``dropout_p`` > 0) are intercepted by a
``TorchFunctionMode``. Each call draws from a generator seeded from (the base seed, the call's key,
the stream's owner rank):

- the stream: a ``DTensor`` input names it by its placements (replicated: the tp group's; sharded:
  the rank's); a plain tensor by the innermost region it runs in (``"shard"`` or ``"replicate"``,
  set per module at install time from the plan);
- the key: every region entry takes the next number of a per-model counter and each call in it
  the next sub-index, so tp ranks (which run the same modules in the same order) agree, and every
  step and micro-batch differs. Under activation checkpointing the recompute of a layer (which
  runs inside the backward) replays the keys its forward took, so it redraws the same masks.

sdpa's internal dropout has no generator argument: it runs with torch's default generator forked
and seeded from the stream (``torch.random.fork_rng``), restored afterwards.
"""

from __future__ import annotations

import collections
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from hf_tp.compat.torch_internals import in_autograd_backward
from hf_tp.dropout.tp_dropout import stream_seed

SHARD, REPLICATE = "shard", "replicate"


class ModelDropout:
    """The dropout streams of one parallelized model on this rank (see the module docstring)."""

    def __init__(self, base_seed: int, rank: int, tp_owner: int) -> None:
        self.base_seed, self.rank, self.tp_owner = base_seed, rank, tp_owner
        self.counter = 0
        self.record: list[tuple[str, int, torch.Tensor]] | None = None  # (module kind, owner, local keep mask)
        self._local = threading.local()  # region stack and mode depth (a thread per rank in tests)
        self._replay: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def _stack(self) -> list[list]:
        if not hasattr(self._local, "stack"):
            self._local.stack, self._local.mode = [], None
        return self._local.stack

    def enter(self, module: nn.Module, kind: str, checkpointed: bool) -> None:
        """Region entry (a forward pre-hook): its key, replayed inside a recompute."""
        recompute = in_autograd_backward()
        if recompute and self._replay[id(module)]:
            key = self._replay[id(module)].popleft()
        else:
            key, self.counter = self.counter, self.counter + 1
            if checkpointed and module.training and torch.is_grad_enabled():
                self._replay[id(module)].append(key)
        stack = self._stack()
        if not stack:
            self._local.mode = _DropoutMode(self)
            self._local.mode.__enter__()
        stack.append([kind, key, 0])

    def leave(self) -> None:
        stack = self._stack()
        stack.pop()
        if not stack:
            self._local.mode.__exit__(None, None, None)
            self._local.mode = None

    def set_kind(self, kind: str) -> None:
        """The rest of the current region runs on tensors of ``kind`` (after its row-parallel
        projection: the reduced output, sequence shards under SP, else whole on every tp rank)."""
        stack = self._stack()
        if stack:
            stack[-1][0] = kind

    def generator(self, x: torch.Tensor, device: torch.device) -> tuple[torch.Generator, int]:
        """A fresh generator for this call's mask, and the owner rank of its stream."""
        region = self._stack()[-1]
        if isinstance(x, DTensor):
            replicated = all(p.is_replicate() for p in x.placements)
        else:
            replicated = region[0] == REPLICATE
        owner = self.tp_owner if replicated else self.rank
        index = region[1] * 4096 + region[2]
        region[2] += 1
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(self.base_seed, index, owner))
        return gen, owner


class _DropoutMode(TorchFunctionMode):
    def __init__(self, streams: ModelDropout) -> None:
        super().__init__()
        self.streams = streams

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p > 0:
                return self._sdpa(args, kwargs, p)
        return func(*args, **kwargs)

    def _dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or p == 0.0:
            return x
        local = x.to_local() if isinstance(x, DTensor) else x
        gen, owner = self.streams.generator(x, local.device)
        keep = torch.empty_like(local).bernoulli_(1.0 - p, generator=gen)
        if self.streams.record is not None:
            self.streams.record.append((self.streams._stack()[-1][0], owner, keep.bool()))
        keep = keep.div_(1.0 - p)
        if isinstance(x, DTensor):
            keep = DTensor.from_local(keep, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
        return x.mul_(keep) if inplace else x * keep

    def _sdpa(self, args, kwargs, p: float):
        q = args[0]
        local = q.to_local() if isinstance(q, DTensor) else q
        gen, owner = self.streams.generator(q, torch.device("cpu"))
        if self.streams.record is not None:
            self.streams.record.append(("sdpa", owner, torch.tensor(p)))
        seed = int(torch.randint(2**62, (1,), generator=gen))
        devices = [local.device] if local.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=local.device.type):
            torch.default_generator.manual_seed(seed)
            if local.device.type != "cpu":
                torch.get_device_module(local.device.type).manual_seed(seed)
            return F.scaled_dot_product_attention(*args, **kwargs)
