"""One optimizer step's data on this rank: the global target count and the local micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_tp.data.collator import PadToMultipleCollator
from hf_tp.data.sampler import GlobalBatchOrder
from hf_tp.labels import count_targets


@dataclass
class StepBatches:
    num_targets: int  # targets in the whole global batch (every dp rank): the loss divisor
    tokens: int  # tokens in the whole global batch
    micro_batches: list[dict[str, torch.Tensor]]  # this rank's, on the device
    num_examples: int = 0  # examples (rows, or preference pairs) in the whole global batch


@dataclass
class StepBatchSource:
    """Builds :class:`StepBatches` for a step from a tokenized dataset and the global batch order."""

    data: object  # a tokenized ``datasets.Dataset`` (rows with ``input_ids``)
    order: GlobalBatchOrder
    collate: PadToMultipleCollator
    dp_rank: int
    dp: int
    micro_batch: int
    grad_accum: int
    device: torch.device

    def __call__(self, step: int) -> StepBatches:
        examples = [self.data[i] for i in self.order.step_indices(step)]
        num_targets = count_batch_targets(examples, step)
        rows = self.order.local_indices(
            step, dp_rank=self.dp_rank, dp=self.dp, micro_batch=self.micro_batch, grad_accum=self.grad_accum
        )
        batches = [to_device(self.collate(self.micro_rows(step, m, r)), self.device) for m, r in enumerate(rows)]
        tokens = sum(len(ex["input_ids"]) + len(ex.get("rejected_input_ids") or ()) for ex in examples)
        return StepBatches(num_targets, tokens, batches, len(examples))

    def micro_rows(self, step: int, micro_step: int, indices: list[int]) -> list:
        """The rows this rank collates for one micro-step (the rows of ``indices``)."""
        return [self.data[i] for i in indices]


def count_batch_targets(examples: list, step: int) -> int:
    """Targets of a global batch, counted from the labels (a copy of input_ids unless the data masks
    some) as the loss takes them; a batch without any is an error naming the step."""
    num_targets = sum(
        count_targets(ex["labels"] if ex.get("labels") is not None else ex["input_ids"])
        + (count_targets(ex["rejected_labels"]) if ex.get("rejected_labels") is not None else 0)  # a pair's
        for ex in examples
    )
    if num_targets == 0:
        raise ValueError(
            f"every label of step {step + 1}'s global batch is masked (no assistant or completion tokens in "
            "its rows, e.g. prompts longer than --seq-len); raise --seq-len, drop such rows, or pass "
            "--no-assistant-only-loss"
        )
    return num_targets


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy a batch without waiting: from pinned memory a CUDA copy is queued behind the running
    kernels; from pageable memory it would block the CPU until they finish."""
    if device.type != "cuda":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
