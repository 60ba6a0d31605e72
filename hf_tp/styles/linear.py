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
    """A per-token module outside the sharded blocks (Gemma 4's per-layer input projection) run on
    the rank's sequence shard: its weights replicated over tp, its input a ``Shard(1)`` DTensor
    taken local (torch's ``SequenceParallel`` would hand ``nn.Linear`` a DTensor whose batch and
    sharded sequence dims it cannot flatten), its output that shard again. Each rank's weight
    gradient covers its own tokens: marked ``Partial`` and summed over tp like the norms'."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()]), param.requires_grad)
            )
        names = [n for n, _ in module.named_parameters(recurse=False)]
        shape: list = []

        def to_local(mod: nn.Module, args):
            x = args[0]
            if not isinstance(x, DTensor) or x.placements != (Shard(1),):
                raise ValueError(f"{type(mod).__name__} runs per token on sequence shards; got {type(x).__name__}")
            shape[:] = [x.shape, x.placements]
            for n in names:  # an instance attribute shadows the registered parameter for the call
                mod.__dict__[n] = mod._parameters[n].to_local(grad_placements=[Partial()])
            return (x.to_local(), *args[1:])

        def to_shards(mod: nn.Module, args, output: torch.Tensor):
            for n in names:
                mod.__dict__.pop(n, None)
            full, placements = shape
            size = torch.Size([*full[:-1], output.shape[-1]])
            stride = torch.empty(size, device="meta").stride()
            return DTensor.from_local(output, device_mesh, placements, run_check=False, shape=size, stride=stride)

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(to_shards)
        return module
