"""Held-out evaluation during training: which rows each rank evaluates, and the eval record.

The evaluated rows are the first ``eval_batches`` global batches of the eval set (all of it for
0), in order, so the set depends only on the data and the global batch size; rank ``d`` of ``dp``
takes rows ``d, d + dp, ...`` in micro-batches. :func:`hf_tp.evaluate` sums the token losses over
every rank and divides by the total target count: the token mean over the evaluated rows, the same
number on every mesh shape.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from hf_tp.data.collator import PadToMultipleCollator
from hf_tp.data.steps import to_device
from hf_tp.labels import IGNORE_INDEX
from hf_tp.parallel.held_out import EvalResult, evaluate, evaluate_pipeline
from hf_tp.pipeline.schedules import Pipeline


@dataclass
class EvalSet:
    """This rank's share of the evaluation set, collated once."""

    data: object  # a tokenized ``datasets.Dataset``
    collate: PadToMultipleCollator
    dp_rank: int
    dp: int
    micro_batch: int
    global_batch: int
    max_batches: int  # global batches to evaluate; 0: all
    device: torch.device

    def __post_init__(self) -> None:
        if len(self.data) == 0:
            raise ValueError("the evaluation set has no rows after tokenization; add data or lower --seq-len")
        self._batches: list[dict[str, torch.Tensor]] | None = None

    @property
    def num_rows(self) -> int:
        n = len(self.data)
        return n if self.max_batches == 0 else min(n, self.max_batches * self.global_batch)

    def local_batches(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches; every rank gets the same number (FSDP2 needs the same
        forwards on each), a rank short of rows gets a batch with no target."""
        if self._batches is None:
            mine = list(range(self.dp_rank, self.num_rows, self.dp))
            per_rank = math.ceil(math.ceil(self.num_rows / self.dp) / self.micro_batch)
            chunks = [mine[i : i + self.micro_batch] for i in range(0, len(mine), self.micro_batch)]
            batches = [self.collate([self.data[i] for i in chunk]) for chunk in chunks]
            filler = {"input_ids": [self.collate.pad_token_id], "labels": [IGNORE_INDEX]}
            if "position_ids" in self.data.column_names:
                filler["position_ids"] = [0]
            batches += [self.collate([filler]) for _ in range(per_rank - len(batches))]
            self._batches = [to_device(b, self.device) for b in batches]
        return self._batches

    @staticmethod
    def due(done: int, every: int, max_steps: int) -> bool:
        """Every ``every`` optimizer steps (0: never) and after the last one."""
        return done == max_steps or bool(every and done % every == 0)

    def run(self, model: torch.nn.Module | Pipeline, *, loss_parallel: bool, fused: bool) -> EvalResult:
        """The token-mean loss of the model (or --pp: this rank's pipeline stages) over the
        evaluated rows (call on every rank)."""
        if isinstance(model, Pipeline):
            return evaluate_pipeline(model, self.local_batches())
        return evaluate(model, self.local_batches(), loss_parallel=loss_parallel, fused=fused)

    def record(self, step: int, model: torch.nn.Module | Pipeline, *, loss_parallel: bool, fused: bool) -> dict:
        """Evaluate after optimizer step ``step`` (1-based): its metrics.jsonl record."""
        start = time.perf_counter()
        result = self.run(model, loss_parallel=loss_parallel, fused=fused)
        return eval_record(step, result, time.perf_counter() - start)


def eval_record(step: int, result: EvalResult, seconds: float) -> dict:
    """The metrics.jsonl record of an evaluation after optimizer step ``step`` (1-based)."""
    return {
        "step": step,
        "split": "eval",
        "eval_loss": result.loss,
        "eval_perplexity": result.perplexity,
        "eval_tokens": result.tokens,
        "eval_time_s": seconds,
    }
