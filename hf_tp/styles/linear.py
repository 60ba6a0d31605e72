"""Linear styles beyond torch's ``ColwiseParallel``/``RowwiseParallel``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
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
    """A per-token module outside the sharded blocks (Gemma 4's per-layer input projection, the
    router and norms of a layer that calls its experts itself) run on the rank's tokens: its weights
    (its submodules' too) replicated over tp, its input a token-sharded DTensor (``Shard(1)`` of the
    residual stream, or the strided shard DTensor makes of it when the layer flattens batch and
    sequence) taken local (torch's ``SequenceParallel`` would re-split a flattened input, and hand
    ``nn.Linear`` a DTensor whose sharded sequence dim it cannot flatten), each output of the same
    rank as the input handed back in the input's layout. Each rank's weight gradient covers its own
    tokens: marked ``Partial`` and summed over tp like the norms'."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = []  # (module, parameter name)
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                dt = distribute_tensor(param, device_mesh, [Replicate()])
                owner.register_parameter(name, nn.Parameter(dt, param.requires_grad))
                owners.append((owner, name))
        layout: list = []

        def to_local(mod: nn.Module, args):
            x = args[0]
            # tokens split over tp (each rank's weight gradient a partial sum), or whole on every rank
            # (a one-token step a layer had to gather: every rank computes the same, whole gradient)
            split = isinstance(x, DTensor) and all(_token_shard(p, x.ndim) for p in x.placements)
            if not split and not (isinstance(x, DTensor) and all(p.is_replicate() for p in x.placements)):
                raise ValueError(f"{type(mod).__name__} runs per token on sequence shards; got {type(x).__name__}")
            layout[:] = [x.shape, x.placements]
            grads = [Partial()] if split else [Replicate()]
            for owner, n in owners:  # an instance attribute shadows the registered parameter for the call
                owner.__dict__[n] = owner._parameters[n].to_local(grad_placements=grads)
            return (x.to_local(), *args[1:])

        def to_shards(mod: nn.Module, args, output):
            for owner, n in owners:
                owner.__dict__.pop(n, None)
            full, placements = layout

            def wrap(out):
                if not torch.is_tensor(out) or out.dim() != len(full):
                    return out
                size = torch.Size([*full[:-1], out.shape[-1]])
                stride = torch.empty(size, device="meta").stride()
                return DTensor.from_local(out, device_mesh, placements, run_check=False, shape=size, stride=stride)

            return tuple(wrap(o) for o in output) if isinstance(output, tuple) else wrap(output)

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(to_shards)
        return module


def _token_shard(placement, ndim: int) -> bool:
    """A shard over tokens: of a dim other than the features (a plain or strided ``Shard``)."""
    dim = getattr(placement, "dim", None)
    return not placement.is_replicate() and not placement.is_partial() and dim is not None and dim % ndim != ndim - 1
