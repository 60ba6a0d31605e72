"""Norm styles beyond torch's ``SequenceParallel`` on the residual stream."""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

HEADS_DIM = 2  # q_proj(x).view(batch, seq, heads, head_dim)


def head_norm() -> SequenceParallel:
    """A norm over ``head_dim`` on this rank's heads (Qwen3/Gemma 3 ``q_norm``/``k_norm``): local
    tensors in and out, replicated weight whose gradient is ``Partial(sum)`` over tp."""
    # torch's SequenceParallel style does exactly this for any dim: it wraps the local input as a
    # Shard(dim) DTensor, replicates the weight, and returns the local output.
    return SequenceParallel(sequence_dim=HEADS_DIM, use_local_output=True)
