"""Preference pairs into batches: a micro-batch of B pairs is one padded batch of 2B rows, the B
chosen rows first and then the B rejected rows in the same order (TRL's layout), so a pair is
always in one micro-batch on one dp rank and both sides are padded to the same length."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_tp.data.collator import PadToMultipleCollator


def is_pair_example(example: Mapping) -> bool:
    """An example of :mod:`hf_tp.data.formats.preference` (it carries its rejected side)."""
    return "rejected_input_ids" in example


@dataclass
class PairCollator:
    """B pair examples -> one batch of 2B rows (chosen, then rejected), padded as ``collate`` pads."""

    collate: PadToMultipleCollator

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        if not examples or not all(is_pair_example(ex) for ex in examples):
            raise ValueError("PairCollator needs preference examples (input_ids, labels, rejected_input_ids, ...)")
        chosen = [{"input_ids": ex["input_ids"], "labels": ex["labels"]} for ex in examples]
        rejected = [{"input_ids": ex["rejected_input_ids"], "labels": ex["rejected_labels"]} for ex in examples]
        batch = self.collate(chosen + rejected)
        if "ref_chosen_logps" in examples[0]:  # --precompute-ref: the reference's log-probs, row by row
            ref = [ex["ref_chosen_logps"] for ex in examples] + [ex["ref_rejected_logps"] for ex in examples]
            batch["ref_logps"] = torch.tensor(ref, dtype=torch.float32)
        return batch
