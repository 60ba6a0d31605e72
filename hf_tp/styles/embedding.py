"""Embedding styles: HF's scaled (Gemma) and normed (Inkling) word embeddings under vocab-sharded ``RowwiseParallel``."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import RowwiseParallel

from hf_tp.compat.torch_internals import child_slots


class ScaledEmbeddingRowwise(RowwiseParallel):
    """``RowwiseParallel`` for HF's scaled word embeddings (``lookup * embed_scale``): the lookup is
    sharded and reduced as usual, and the scale is applied to the reduced output.

    On the vocab-sharded lookup (a partial sum) the product would make DTensor all-reduce the whole
    ``b x s x h`` output before the reduce-scatter; each token's row is nonzero on one rank only, so
    scaling after the reduction gives the same values.

    ``output_norm`` names a norm child the embedding applies to its lookup (Inkling's
    ``embed_norm``): a norm of the partial lookup is not the norm of the sum, so it runs after the
    reduce-scatter (and the scale), on sequence shards, under the plan's own style for it; the
    vocab split covers the embedding's own weight only.
    """

    def __init__(self, *args, output_norm: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.output_norm = output_norm

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        scaled = hasattr(module, "embed_scale")
        if not scaled and not self.output_norm:
            return super()._apply(module, device_mesh)
        module.forward = types.MethodType(nn.Embedding.forward, module)  # the lookup alone
        norm = child_slots(module).pop(self.output_norm) if self.output_norm else None  # (not vocab-split)
        module = super()._apply(module, device_mesh)  # registers the reduce-scatter as a forward hook
        if scaled:
            module.register_forward_hook(_scale_output)  # runs after it
        if norm is not None:
            module.add_module(self.output_norm, norm)
            module.register_forward_hook(lambda mod, args, output: getattr(mod, self.output_norm)(output))
        return module


def _scale_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    scale = module.embed_scale
    if not isinstance(scale, torch.Tensor):  # a Python float (XGLM's, BioGPT's): HF multiplies by it as is
        return output * scale
    scale = scale.to(module.weight.dtype)  # HF's expression, same rounding
    if isinstance(scale, DTensor) and not isinstance(output, DTensor):
        scale = scale.to_local()  # distribute_module replicated the buffer; the output is local without SP
    return output * scale
