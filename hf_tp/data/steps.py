"""One optimizer step's data on this rank: the global target count and the local micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_tp.data.collator import PadToMultipleCollator
from hf_tp.data.sampler import GlobalBatchPlan


@dataclass
class StepBatches:
    num_targets: int  # targets in the whole global batch (every dp rank): the loss divisor
    tokens: int  # tokens in the whole global batch
    micro_batches: list[dict[str, torch.Tensor]]  # this rank's, on the device


@dataclass
class StepBatchSource:
    """Builds :class:`StepBatches` for a step from a tokenized dataset and the global batch plan."""

    data: object  # a tokenized ``datasets.Dataset`` (rows with ``input_ids``)
    plan: GlobalBatchPlan
    collate: PadToMultipleCollator
    dp_rank: int
    dp: int
    micro_batch: int
    grad_accum: int
    device: torch.device

    def __call__(self, step: int) -> StepBatches:
        examples = [self.data[i]["input_ids"] for i in self.plan.step_indices(step)]
        # HF shifts labels by one inside the model: a sequence of n tokens has n - 1 targets.
        num_targets = sum(max(len(ids) - 1, 0) for ids in examples)
        rows = self.plan.local_indices(
            step, dp_rank=self.dp_rank, dp=self.dp, micro_batch=self.micro_batch, grad_accum=self.grad_accum
        )
        batches = [to_device(self.collate([self.data[i] for i in r]), self.device) for r in rows]
        return StepBatches(num_targets, sum(len(ids) for ids in examples), batches)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy a batch without waiting: from pinned memory a CUDA copy is queued behind the running
    kernels; from pageable memory it would block the CPU until they finish."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
