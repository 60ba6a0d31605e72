"""Embedding styles: HF's scaled word embeddings (Gemma) under vocab-sharded ``RowwiseParallel``."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel


class ScaledEmbeddingRowwise(RowwiseParallel):
    """``RowwiseParallel`` for HF's scaled word embeddings (``lookup * embed_scale``): the lookup is
    sharded and reduced as usual, and the scale is applied to the reduced output.

    On the vocab-sharded lookup (a partial sum) the product would make DTensor all-reduce the whole
    ``b x s x h`` output before the reduce-scatter; each token's row is nonzero on one rank only, so
    scaling after the reduction gives the same values.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not hasattr(module, "embed_scale"):
            return super()._apply(module, device_mesh)
        module.forward = types.MethodType(nn.Embedding.forward, module)  # the lookup alone
        module = super()._apply(module, device_mesh)  # registers the reduce-scatter as a forward hook
        module.register_forward_hook(_scale_output)  # runs after it
        return module


def _scale_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    scale = module.embed_scale.to(module.weight.dtype)  # HF's expression, same rounding
    if isinstance(scale, DTensor) and not isinstance(output, DTensor):
        scale = scale.to_local()  # distribute_module replicated the buffer; the output is local without SP
    return output * scale
