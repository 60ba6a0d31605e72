"""Norm styles beyond torch's ``SequenceParallel`` on the residual stream."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

HEADS_DIM = 2  # q_proj(x).view(batch, seq, heads, head_dim)


def head_norm() -> SequenceParallel:
    """A norm over ``head_dim`` on this rank's heads (Qwen3/Gemma 3 ``q_norm``/``k_norm``): local
    tensors in and out, replicated weight whose gradient is ``Partial(sum)`` over tp."""
    # torch's SequenceParallel style does exactly this for any dim: it wraps the local input as a
    # Shard(dim) DTensor, replicates the weight, and returns the local output.
    return SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)


class WidthNormParallel(ParallelStyle):
    """A norm over the whole width of a column-parallel output (OLMo 2/3 normalise q and k over all
    heads, before splitting them): the input is this rank's columns, the weight is sharded with
    them, and the mean over the width becomes one small all-reduce of per-token sums (DTensor's
    reduction over the sharded dim). Local tensors in and out, like the projection around it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                if param.dim() != 1:
                    raise ValueError(f"WidthNormParallel expects vector parameters, got {pname} {tuple(param.shape)}")
                mod.register_parameter(
                    pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
                )

        return distribute_module(
            module,
            device_mesh,
            shard_params,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False) if i == 0 else x
                for i, x in enumerate(inputs)
            ),
            output_fn=lambda mod, out, mesh: out.to_local() if isinstance(out, DTensor) else out,
        )
