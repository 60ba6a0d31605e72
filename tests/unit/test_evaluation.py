"""EvalSet: the evaluated rows depend only on the eval set and the global batch; every dp rank runs
the same number of forwards (a short rank gets a batch with no target)."""

from __future__ import annotations

import datasets
import pytest
import torch

from hf_tp.data import PadToMultipleCollator
from hf_tp.labels import IGNORE_INDEX
from hf_tp.train.evaluation import EvalSet

ROWS = datasets.Dataset.from_list([{"input_ids": [10 + i, 20, 30], "labels": [10 + i, 20, 30]} for i in range(7)])


def rows_seen(dp: int, micro_batch: int, max_batches: int, global_batch: int) -> tuple[list[int], set[int]]:
    seen, counts = [], set()
    for rank in range(dp):
        eval_set = EvalSet(
            ROWS, PadToMultipleCollator(0, 2), rank, dp, micro_batch, global_batch, max_batches, torch.device("cpu")
        )
        batches = eval_set.local_batches()
        counts.add(len(batches))
        for b in batches:
            real = b["labels"][:, 0] != IGNORE_INDEX
            seen += (b["input_ids"][real, 0] - 10).tolist()
            assert not (b["labels"][~real] != IGNORE_INDEX).any()  # filler rows hold no target
    return sorted(seen), counts


@pytest.mark.parametrize(("dp", "micro_batch"), [(1, 4), (2, 2), (2, 1), (4, 1)])
def test_every_mesh_evaluates_the_same_rows(dp: int, micro_batch: int) -> None:
    seen, counts = rows_seen(dp, micro_batch, 0, 4)
    assert seen == list(range(7)) and len(counts) == 1
    seen, counts = rows_seen(dp, micro_batch, 1, 4)  # --eval-batches 1: the first global batch only
    assert seen == list(range(4)) and len(counts) == 1


def test_due_every_n_steps_and_at_the_end() -> None:
    assert [s for s in range(1, 8) if EvalSet.due(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if EvalSet.due(s, 0, 7)] == [7]
