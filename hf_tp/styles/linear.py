"""Linear styles beyond torch's ``ColwiseParallel``/``RowwiseParallel``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from hf_tp.compat.torch_internals import parameter_slots, pop_own_attribute, set_own_attribute
from hf_tp.compat.torch_styles import ColwiseOwnOutput  # noqa: F401  (hf_tp.styles' name for it)


class ColwiseGatherIn(ColwiseParallel):
    """``ColwiseParallel`` that all-gathers its own input from sequence shards: the up projection of
    an MLP a decoder layer runs itself (OPT's ``fc1``), with no block around it to gather for it."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Shard(1))


class PerTokenOnShards(ParallelStyle):
    """A per-token module outside the sharded blocks (Gemma 4's per-layer input projection, the
    router and norms of a layer that calls its experts itself, hyper-connection mixers) run on the
    rank's tokens: its weights (its submodules' too) replicated over tp, its input a token-sharded
    DTensor (``Shard(1)`` of the residual stream, or the strided shard DTensor makes of it when the
    layer flattens batch and sequence) taken local (torch's ``SequenceParallel`` would re-split a
    flattened input, and hand ``nn.Linear`` a DTensor whose sharded sequence dim it cannot
    flatten), each output that holds the rank's tokens handed back in the input's layout. No
    forward collective. Each rank's weight gradient covers its own tokens: marked ``Partial`` and
    summed over tp like the norms'. Tokens whole on every rank (a one-token step a layer had to
    gather, :mod:`hf_tp.parallel.one_token`) give every rank the same, whole gradient. A rank
    without tokens (a one-token decode step at tp > 1) runs the module on one zero token and
    returns none (a reshape of zero tokens to ``(batch, 0, -1)`` is ambiguous)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = []  # (module, parameter name)
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                dt = distribute_tensor(param, device_mesh, [Replicate()])
                owner.register_parameter(name, nn.Parameter(dt, param.requires_grad))
                owners.append((owner, name))
        state: list = []

        def to_local(mod: nn.Module, args):
            x = args[0]
            full, placements = self._layout(mod, x)
            dim = _token_dim(placements, len(full))
            local = x.to_local() if isinstance(x, DTensor) else x
            empty = dim is not None and local.shape[dim] == 0
            if empty:
                local = local.new_zeros(*local.shape[:dim], 1, *local.shape[dim + 1 :])
            state[:] = [TokenLayout(full, placements, dim, local.shape[: (dim or 0) + 1], empty)]
            grads = [Partial()] if dim is not None else [Replicate()]
            for owner, n in owners:  # an instance attribute shadows the registered parameter for the call
                set_own_attribute(owner, n, parameter_slots(owner)[n].to_local(grad_placements=grads))
            return (local, *args[1:])

        def to_shards(mod: nn.Module, args, output):
            for owner, n in owners:
                pop_own_attribute(owner, n)
            tokens = state[0]
            each = [self._wrap(o, tokens, device_mesh) for o in (output if isinstance(output, tuple) else [output])]
            return tuple(each) if isinstance(output, tuple) else each[0]

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(to_shards)
        return module

    def _layout(self, mod: nn.Module, x) -> tuple[torch.Size, tuple]:
        """The whole input's shape and placements: tokens split over tp, or whole on every rank."""
        split = isinstance(x, DTensor) and all(_token_dim((p,), x.ndim) is not None for p in x.placements)
        if not split and not (isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements)):
            raise ValueError(f"{type(mod).__name__} runs per token on sequence shards; got {type(x).__name__}")
        return x.shape, tuple(x.placements)

    def _wrap(self, out, tokens: TokenLayout, device_mesh: DeviceMesh):
        """One output as what the model gets: one that holds the rank's tokens in the input's
        layout (a DTensor of all tokens), anything else as it is."""
        if not torch.is_tensor(out) or isinstance(out, DTensor) or out.dim() < 2:
            return out
        if tokens.dim is None:  # whole on every rank
            if out.dim() != len(tokens.full):
                return out
            return token_shards(out, tokens.placements, out.shape, device_mesh)
        d = tokens.dim
        if out.dim() <= d or out.shape[: d + 1] != tokens.local:
            return out
        if tokens.empty:
            out = out.narrow(d, 0, 0)
        size = torch.Size([*out.shape[:d], tokens.full[d], *out.shape[d + 1 :]])
        return token_shards(out, tokens.placements, size, device_mesh)


@dataclass(frozen=True)
class TokenLayout:
    """The input :class:`PerTokenOnShards` took local: its whole shape and placements, the dim its
    tokens are split on (None: whole on every rank), the local leading dims up to it, and whether
    the rank had none (run on one zero token)."""

    full: torch.Size
    placements: tuple
    dim: int | None
    local: torch.Size
    empty: bool


def _token_dim(placements, ndim: int) -> int | None:
    """The dim the tokens are split on (a plain or strided ``Shard`` of a dim other than the
    features), or None where every placement replicates."""
    dims = set()
    for p in placements:
        dim = getattr(p, "dim", None)
        if not p.is_replicate() and not p.is_partial() and dim is not None and dim % ndim != ndim - 1:
            dims.add(dim % ndim)
    return dims.pop() if len(dims) == 1 else None


def token_shards(local: torch.Tensor, placements, size: torch.Size, device_mesh: DeviceMesh) -> DTensor:
    """The rank's part ``local`` as the DTensor of global ``size`` (shards may be uneven: the
    global shape is given)."""
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=size, stride=stride)


def sequence_shards(local: torch.Tensor, seq: int, device_mesh: DeviceMesh) -> DTensor:
    """The rank's tokens ``local`` (dims batch, its sequence shard, ...) as the ``Shard(1)``
    DTensor of all ``seq`` tokens."""
    return token_shards(local, (Shard(1),), torch.Size([local.shape[0], seq, *local.shape[2:]]), device_mesh)
