"""KV heads replicated over tp when tp is larger than ``num_key_value_heads`` (Megatron does this).

With grouped-query attention each KV head serves ``heads / kv`` query heads. Sharding heads over
tp needs tp | kv; when kv < tp (Qwen2.5-3B: 16 heads, 2 KV heads, at tp=4 or 8), each rank's
query heads all read one KV head, so that head must live on the ``tp / kv`` ranks that share it.

There is no DTensor placement for "sharded over groups of ranks", so the k/v projection weight
stays whole on every rank (``Replicate``: GQA makes it small) and each rank multiplies by the rows
of its own KV head only. Weight and input enter as their local tensors handed to autograd as
``Partial``: each rank's gradient is one term of a sum over tp (zero outside its KV head's rows),
so the weight gradient is ``Partial(sum)``, reduced with the other tp-replicated weights
(:mod:`hf_tp.parallel.partial_grads`), and the input gradient joins the query projection's
``Partial`` sum that sequence parallelism reduce-scatters. The attention module's
``num_key_value_groups`` becomes the local ``heads / tp`` query heads per (one) local KV head.

Cost against Megatron, which keeps each KV head's weight only on the ranks of its group: the
fused gradient all-reduce carries the whole k/v weights (kv times the rows each rank touched), and
optimizer state is kept for all of them on every tp rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hf_tp.core.record import reclass


class ReplicatedKVProjection(ParallelStyle):
    """``k_proj``/``v_proj`` when ``tp = replicas * num_key_value_heads``: whole weight on every
    rank, only the one KV head that this rank's query heads use computed (a local tensor)."""

    def __init__(self, replicas: int) -> None:
        super().__init__()
        if replicas < 2:
            raise ValueError(f"ReplicatedKVProjection needs replicas >= 2, got {replicas}; use ColwiseParallel")
        self.replicas = replicas

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Linear:
            raise ValueError(f"ReplicatedKVProjection expects an nn.Linear, got {type(module).__name__}")
        tp = device_mesh.size()
        if tp % self.replicas:
            raise ValueError(f"tp ({tp}) is not a multiple of the KV-head replicas ({self.replicas})")
        kv = tp // self.replicas
        if module.out_features % kv:
            raise ValueError(f"{module.out_features} output features do not split into {kv} KV heads")

        def replicate_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), param.requires_grad)
                mod.register_parameter(pname, dist_param)

        distribute_module(module, device_mesh, replicate_params)
        reclass(module, KVHeadLinear)  # same parameters and state dict keys, its own forward (recorded)
        module.head_dim = module.out_features // kv
        module.head_start = (device_mesh.get_local_rank() // self.replicas) * module.head_dim
        return module


class KVHeadLinear(nn.Linear):
    """An ``nn.Linear`` with a tp-replicated weight that computes only rows
    ``[head_start, head_start + head_dim)`` of its output (see :class:`ReplicatedKVProjection`)."""

    head_start: int
    head_dim: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = slice(self.head_start, self.head_start + self.head_dim)
        weight = self.weight.to_local(grad_placements=[Partial()])[rows]
        bias = self.bias.to_local(grad_placements=[Partial()])[rows] if self.bias is not None else None
        if isinstance(x, DTensor):  # sequence parallel: the all-gathered (Replicate) activation
            if not all(p.is_replicate() for p in x.placements):
                x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
            x = x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
        else:  # without SP the activation is already whole on every rank; its gradient is summed
            mesh = self.weight.device_mesh
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        return F.linear(x, weight, bias)


def set_local_kv_groups(attention: nn.Module, num_heads: int, tp: int) -> None:
    """Point HF's attention at the local head counts: ``heads / tp`` query heads per KV head."""
    if not hasattr(attention, "num_key_value_groups"):
        raise ValueError(
            f"{type(attention).__name__} has no num_key_value_groups; hf_tp cannot replicate its KV heads "
            f"(tp must divide num_key_value_heads for this model)"
        )
    attention.num_key_value_groups = num_heads // tp
