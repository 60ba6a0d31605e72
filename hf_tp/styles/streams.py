"""Hyper-connections under sequence parallelism: a residual of several streams per token.

DeepSeek-V4, HY-V4 and Qwen4-Exp carry ``k`` copies of the hidden state per token
(``[batch, seq, k, hidden]``, or flattened) between decoder layers. Small mixers (``attn_hc``,
``ffn_hc``, ``hc_head``; Qwen4-Exp's gated residuals) collapse the streams into one block input,
and the layer itself expands the block's output back and mixes it with the streams (a ``matmul``
over the stream dim, per token). All of it is per token, so it runs on each rank's sequence shard:
the mixers' weights replicated (their gradients ``Partial``, summed over tp with the norms'), the
layer's own arithmetic on plain tensors of the rank's tokens. Plain tensors, because DTensor
cannot reshape a sharded sequence dim of size one (a one-token decode step: ``matmul`` folds it
away) and a shard of zero tokens cannot be viewed as ``(batch, 0, -1)``.

:class:`HyperConnectionLayer` (on the decoder layer) takes the residual local on entry, gives the
layer's output back as the sequence-sharded DTensor, and takes the blocks' outputs local;
:class:`HyperConnectionOnShards` (on each mixer) hands the collapsed block input on as that
DTensor, so the norms and blocks see the whole sequence's shape. A mixer outside the layers (the
final collapse) gets the DTensor residual and returns DTensors, as :class:`PerTokenOnShards`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hf_tp.styles.linear import PerTokenOnShards, TokenLayout, sequence_shards

_FULL = "_hf_tp_stream_shape"  # the global shape of a layer's residual, on its local shard


class StreamShape:
    """The shape of the residual a hyper-connection layer took in (shared by its styles)."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden  # a block's input width: the collapsed stream
        self.full: torch.Size | None = None


class HyperConnectionOnShards(PerTokenOnShards):
    """A hyper-connection mixer on the rank's tokens. Inside a :class:`HyperConnectionLayer` its
    input is the layer's plain residual shard: the collapsed output (``hidden`` wide, the next
    block's input) becomes the sequence-sharded DTensor, the mixing weights stay plain."""

    def __init__(self, stream: StreamShape | None = None) -> None:
        super().__init__()
        self.stream = stream

    def _layout(self, mod: nn.Module, x) -> tuple[torch.Size, tuple]:
        if self.stream is not None and getattr(x, _FULL, None) is not None:
            # the layer's own input: a recompute of the layer under activation checkpointing (which
            # replays its forward, not its hooks) learns the streams' shape from it
            self.stream.full = getattr(x, _FULL)
        if isinstance(x, DTensor) or self.stream is None or self.stream.full is None:
            return super()._layout(mod, x)
        return self.stream.full, (Shard(1),)

    def _wrap(self, out, tokens: TokenLayout, device_mesh: DeviceMesh):
        inside = self.stream is not None and self.stream.full is tokens.full
        if inside and torch.is_tensor(out) and out.shape[-1] != self.stream.hidden:
            return out  # mixing weights (or the streams passed through) for the layer's own arithmetic
        return super()._wrap(out, tokens, device_mesh)


class HyperConnectionLayer(ParallelStyle):
    """A decoder layer whose residual has hyper-connection streams: its own arithmetic (expanding
    a block's output into the streams, mixing them) runs on plain tensors of the rank's tokens.
    ``blocks``: its children whose outputs are sequence-sharded DTensors, taken local."""

    def __init__(self, stream: StreamShape, blocks: tuple[str, ...]) -> None:
        super().__init__()
        self.stream = stream
        self.blocks = blocks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        stream = self.stream

        def enter(mod: nn.Module, args: tuple, kwargs: dict):
            x = args[0] if args else kwargs["hidden_states"]
            if not isinstance(x, DTensor) or x.placements != (Shard(1),):
                raise ValueError(f"{type(mod).__name__}'s residual streams must be sequence shards; got {type(x)}")
            stream.full = x.shape
            local = x.to_local()
            setattr(local, _FULL, x.shape)  # kept with the input activation checkpointing saves
            if args:
                return (local, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": local}

        def leave(mod: nn.Module, args: tuple, kwargs: dict, output):
            first = output[0] if isinstance(output, tuple) else output
            out = sequence_shards(first, stream.full[1], device_mesh)
            stream.full = None
            return (out, *output[1:]) if isinstance(output, tuple) else out

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True)
        for name, child in module.named_children():
            if name in self.blocks:
                child.register_forward_hook(_local_output)
        return module


def _local_output(mod: nn.Module, args: tuple, output):
    """A block's sequence-sharded output as the rank's plain tokens (its gradient flows back as
    the same shards)."""
    if isinstance(output, tuple):
        return tuple(t.to_local() if isinstance(t, DTensor) else t for t in output)
    return output.to_local() if isinstance(output, DTensor) else output
