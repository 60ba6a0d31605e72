"""Which examples each optimizer step trains on, and how a step's batch is split over ranks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import torch

T = TypeVar("T")


@lru_cache(maxsize=4)  # a step reads at most a few epochs, and consecutive steps the same ones
def _epoch_order(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s permutation of the example indices (do not modify: it is cached)."""
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + epoch))


@dataclass(frozen=True)
class GlobalBatchOrder:
    """Which examples form each optimizer step's global batch: depends only on the seed and the
    global batch size, never on how the batch is split over dp ranks and micro-steps.

    The example stream is epoch 0, epoch 1, ... back to back, where epoch ``e`` is
    ``torch.randperm(num_examples)`` seeded with ``seed + e``; step ``s`` takes the stream's
    ``global_batch`` examples from ``s * global_batch`` on, so a step may straddle two epochs.
    """

    num_examples: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise ValueError(f"the dataset has no examples (num_examples={self.num_examples}); add data")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer, got global_batch={self.global_batch}")

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in one epoch: ``num_examples // global_batch``.

        0 when the global batch is larger than the dataset; steps do not restart at epoch
        boundaries, so this is a guide for choosing ``max_steps``, not where epochs start.
        """
        return self.num_examples // self.global_batch

    def step_indices(self, step: int) -> list[int]:
        """The ``global_batch`` example indices of optimizer step ``step`` (0-based), in order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got step={step}")
        start, stop = step * self.global_batch, (step + 1) * self.global_batch
        n = self.num_examples
        out: list[int] = []
        for epoch in range(start // n, (stop - 1) // n + 1):  # only the epochs this step touches
            lo, hi = max(start - epoch * n, 0), min(stop - epoch * n, n)
            out.extend(_epoch_order(n, self.seed, epoch)[lo:hi].tolist())
        return out

    def local_indices(self, step: int, *, dp_rank: int, dp: int, micro_batch: int, grad_accum: int) -> list[list[int]]:
        """The rows of step ``step`` for dp rank ``dp_rank``: one list of ``micro_batch`` indices per
        micro-step. Micro-step ``m`` of rank ``d`` takes slot ``m * dp + d`` of the global batch, so
        each micro-step's rows over all ranks are a contiguous slice of it.
        """
        for name, value in (("dp", dp), ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {name}={value}")
        if micro_batch * dp * grad_accum != self.global_batch:
            raise ValueError(
                f"global_batch ({self.global_batch}) must equal micro_batch * dp * grad_accum "
                f"({micro_batch}*{dp}*{grad_accum}={micro_batch * dp * grad_accum})"
            )
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank must be in [0, {dp}), got dp_rank={dp_rank}")
        return split_global_batch(
            self.step_indices(step), dp_rank=dp_rank, dp=dp, micro_batch=micro_batch, grad_accum=grad_accum
        )


def split_global_batch(items: list[T], *, dp_rank: int, dp: int, micro_batch: int, grad_accum: int) -> list[list[T]]:
    """Rank ``dp_rank``'s micro-batches of a global batch: micro-step ``m`` takes slot ``m * dp + dp_rank``."""
    slots = [m * dp + dp_rank for m in range(grad_accum)]
    return [items[slot * micro_batch : (slot + 1) * micro_batch] for slot in slots]
