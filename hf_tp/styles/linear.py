"""Linear styles beyond torch's ``ColwiseParallel``/``RowwiseParallel``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


class ColwiseOwnOutput(ColwiseParallel):
    """``ColwiseParallel`` whose local output is a tensor of its own, not a view of the DTensor
    output: attention code that edits projections in place (OLMo's ``query_states.clamp_`` under
    ``clip_qkv``) fails on such a view ("a view ... is being modified inplace"). Costs one copy."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output else out


class PerTokenOnShards(ParallelStyle):
    """A per-token module outside the sharded blocks run on the rank's sequence shard (Gemma 4's
    per-layer input projection): its weights (its submodules' too) replicated over tp, its input
    a ``Shard(1)`` DTensor taken local (torch's ``SequenceParallel`` would hand ``nn.Linear`` a
    DTensor whose batch and sharded sequence dims it cannot flatten), each tensor it returns that
    shard again. No forward collective. Each rank's weight gradient covers its own tokens: marked
    ``Partial`` and summed over tp like the norms'. A rank without tokens (a one-token decode step
    at tp > 1) runs the module on one zero token and returns none (a reshape of zero tokens to
    ``(batch, 0, -1)`` is ambiguous)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = {}  # submodule -> its own parameter names
        for sub in module.modules():
            names = [n for n, _ in sub.named_parameters(recurse=False)]
            for name in names:
                param = sub._parameters[name]
                replicated = distribute_tensor(param, device_mesh, [Replicate()])
                sub.register_parameter(name, nn.Parameter(replicated, param.requires_grad))
            if names:
                owners[sub] = names
        state: list = []

        def to_local(mod: nn.Module, args):
            x = args[0]
            full = self._global_shape(mod, x)
            local = x.to_local() if isinstance(x, DTensor) else x
            empty = local.shape[1] == 0
            if empty:
                local = local.new_zeros(local.shape[0], 1, *local.shape[2:])
            state[:] = [full, empty]
            for sub, names in owners.items():  # an instance attribute shadows the registered parameter
                for n in names:
                    sub.__dict__[n] = sub._parameters[n].to_local(grad_placements=[Partial()])
            return (local, *args[1:])

        def to_shards(mod: nn.Module, args, output):
            for sub, names in owners.items():
                for n in names:
                    sub.__dict__.pop(n, None)
            full, empty = state
            each = [
                t[:, :0] if empty and _per_token(t) else t for t in (output if isinstance(output, tuple) else [output])
            ]
            each = [self._wrap(t, full, device_mesh) if _per_token(t) else t for t in each]
            return tuple(each) if isinstance(output, tuple) else each[0]

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(to_shards)
        return module

    def _global_shape(self, mod: nn.Module, x) -> torch.Size:
        """The whole input's shape (its sequence dim that of all ranks' tokens)."""
        if not isinstance(x, DTensor) or x.placements != (Shard(1),):
            raise ValueError(f"{type(mod).__name__} runs per token on sequence shards; got {type(x).__name__}")
        return x.shape

    def _wrap(self, output: torch.Tensor, full: torch.Size, device_mesh: DeviceMesh):
        """One per-token output as what the model gets: the sequence-sharded DTensor."""
        return sequence_shards(output, full[1], device_mesh)


def _per_token(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() >= 2


def sequence_shards(local: torch.Tensor, seq: int, device_mesh: DeviceMesh) -> DTensor:
    """The rank's tokens ``local`` (dims batch, its sequence shard, ...) as the ``Shard(1)``
    DTensor of all ``seq`` tokens (shards may be uneven: the global shape is given)."""
    size = torch.Size([local.shape[0], seq, *local.shape[2:]])
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, device_mesh, [Shard(1)], run_check=False, shape=size, stride=stride)
