"""Turning a list of token-id examples into one right-padded training batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_tp.labels import IGNORE_INDEX

_Maybe = torch.Tensor | None


# Hand-written rather than a transformers collator (checked against transformers 5.23):
# - DataCollatorForLanguageModeling(mlm=False) rebuilds labels from input_ids, ignoring a given
#   "labels" field, and sets -100 wherever a token equals pad_token_id; with pad == eos (common)
#   that drops the loss on every real eos token of packed data.
# - DataCollatorWithPadding never creates labels and does not pad a given "labels" field (unequal
#   lengths fail; equal ones come back shorter than the padded input_ids).
# - DataCollatorForSeq2Seq pads given labels with -100 but does not create them when absent.
# All three also need a tokenizer object and follow its padding_side, which may be "left"; here
# only the pad id is needed and padding is always on the right.
@dataclass
class PadToMultipleCollator:
    """Right-pads a batch so the sequence length is a multiple of `multiple_of` (the tp size).

    Examples hold ``input_ids`` and optionally ``labels`` and ``attention_mask`` of the same
    length. Labels default to a copy of ``input_ids`` (HF causal LMs shift them themselves) and are
    -100 on padding, so padding never counts in the loss.

    Packed examples with ``position_ids`` (restarting per document) give a batch with
    ``position_ids`` and no ``attention_mask``: transformers builds the per-document causal mask
    from ``position_ids`` only when no attention mask is passed. The padding then gets positions
    0, 1, ... of its own, a segment that no real token attends to (it comes after them).
    """

    pad_token_id: int
    multiple_of: int = 1
    # Also return ``row_lengths`` (tokens before the padding, per row): the training loop's MoE aux
    # loss leaves the tp padding out, as single-device HF never sees it. Not a model input.
    row_lengths: bool = False

    def __post_init__(self) -> None:
        if self.multiple_of < 1:
            raise ValueError(f"multiple_of must be a positive integer, got multiple_of={self.multiple_of}")
        if self.pad_token_id is None:
            raise ValueError("pad_token_id is None; pass the tokenizer's pad id (or its eos id when it has no pad)")

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        if self.multiple_of < 1:  # the field may have been changed after construction
            raise ValueError(f"multiple_of must be a positive integer, got multiple_of={self.multiple_of}")
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        rows = [_as_row(ex, i) for i, ex in enumerate(examples)]
        longest = max(len(ids) for ids, _, _ in rows)
        length = -(-longest // self.multiple_of) * self.multiple_of  # round up
        packed = [ex.get("position_ids") is not None for ex in examples]
        if any(packed):
            if not all(packed):
                raise ValueError("either every example of a batch has position_ids or none has")
            return self._packed(examples, rows, length)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        for i, (ids, mask, lab) in enumerate(rows):
            n = len(ids)
            input_ids[i, :n] = ids
            attention_mask[i, :n] = 1 if mask is None else mask
            labels[i, :n] = ids if lab is None else lab
        return self._with_lengths({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}, rows)

    def _packed(self, examples, rows, length: int) -> dict[str, torch.Tensor]:
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.arange(length, dtype=torch.long).repeat(len(rows), 1)
        for i, ((ids, _, lab), ex) in enumerate(zip(rows, examples, strict=True)):
            n = len(ids)
            positions = torch.as_tensor(ex["position_ids"], dtype=torch.long).reshape(-1)
            if len(positions) != n:
                raise ValueError(f"example {i} has {len(positions)} position_ids but {n} input_ids")
            input_ids[i, :n] = ids
            labels[i, :n] = ids if lab is None else lab
            position_ids[i, :n] = positions
            position_ids[i, n:] -= n  # the padding: a segment of its own, starting at 0
        return self._with_lengths({"input_ids": input_ids, "labels": labels, "position_ids": position_ids}, rows)

    def _with_lengths(self, batch: dict[str, torch.Tensor], rows) -> dict[str, torch.Tensor]:
        if self.row_lengths:
            batch["row_lengths"] = torch.tensor([len(ids) for ids, _, _ in rows], dtype=torch.long)
        return batch


def _as_row(example: Mapping[str, Sequence[int]], i: int) -> tuple[torch.Tensor, _Maybe, _Maybe]:
    """``(input_ids, attention_mask or None, labels or None)`` of one example as 1-D long tensors."""
    if "input_ids" not in example:
        raise ValueError(f"example {i} has no 'input_ids'; its keys are: {', '.join(map(str, example))}")
    ids = torch.as_tensor(example["input_ids"], dtype=torch.long).reshape(-1)
    extra: list[torch.Tensor | None] = []
    for key in ("attention_mask", "labels"):
        value = example.get(key)
        if value is not None:
            value = torch.as_tensor(value, dtype=torch.long).reshape(-1)
            if len(value) != len(ids):
                raise ValueError(
                    f"example {i} has {len(value)} {key} but {len(ids)} input_ids; they must have the same length"
                )
        extra.append(value)
    return ids, extra[0], extra[1]
