"""Held-out evaluation of a preference objective: its loss and TRL's metrics (``eval_rewards/*``,
``eval_logps/*``) as means over the evaluated pairs, the same numbers on every mesh shape.

The evaluated pairs are the first ``eval_batches`` global batches of the eval set (all of it for
0), in order; dp rank ``d`` takes pairs ``d, d + dp, ...`` in micro-batches. Every rank runs the
same number of forwards (FSDP2's collectives): a rank short of pairs runs a copy of the first one
whose result is left out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_tp.data.pairs import PairCollator
from hf_tp.data.steps import StepBatches, to_device
from hf_tp.objectives.base import Objective
from hf_tp.parallel.generate import eval_mode
from hf_tp.train.evaluation import EvalSet


@dataclass
class PairEvalSet:
    """This rank's share of the preference evaluation set; :meth:`bind` gives it the objective."""

    data: object  # tokenized pair examples (a ``datasets.Dataset``)
    collate: PairCollator
    dp_rank: int
    dp: int
    micro_batch: int
    global_batch: int
    max_batches: int  # global batches to evaluate; 0: all
    device: torch.device
    objective: Objective | None = None
    group: dist.ProcessGroup | None = None  # the dp ranks

    due = staticmethod(EvalSet.due)

    def bind(self, objective: Objective, group: dist.ProcessGroup) -> None:
        self.objective, self.group = objective, group

    @property
    def num_rows(self) -> int:
        n = len(self.data)
        return n if self.max_batches == 0 else min(n, self.max_batches * self.global_batch)

    def local_batches(self) -> list[tuple[dict[str, torch.Tensor], float]]:
        """This rank's micro-batches, each with its weight (0: a filler that only keeps step)."""
        mine = list(range(self.dp_rank, self.num_rows, self.dp))
        per_rank = math.ceil(math.ceil(self.num_rows / self.dp) / self.micro_batch)
        chunks = [mine[i : i + self.micro_batch] for i in range(0, len(mine), self.micro_batch)]
        batches = [(self.collate([self.data[i] for i in chunk]), 1.0) for chunk in chunks]
        batches += [(self.collate([self.data[0]]), 0.0) for _ in range(per_rank - len(batches))]
        return [(to_device(b, self.device), w) for b, w in batches]

    def record(self, step: int, model: torch.nn.Module, **_) -> dict:
        """Evaluate after optimizer step ``step`` (1-based; call on every rank): its metrics.jsonl record."""
        start = time.perf_counter()
        per_batch = StepBatches(0, 0, [], num_examples=1)  # the loss as a sum over the batch's pairs
        totals: dict[str, torch.Tensor] = {}
        with torch.no_grad(), eval_mode(model):
            for batch, weight in self.local_batches():
                out = self.objective.micro_loss(model, batch, per_batch)
                for name, value in {"loss": out.loss, **out.sums}.items():
                    totals[name] = totals.get(name, 0) + value.detach().float() * weight
        names = sorted(totals)
        summed = torch.stack([totals[n] for n in names])
        dist.all_reduce(summed, group=self.group)
        means = {f"eval_{n}": v / self.num_rows for n, v in zip(names, summed.tolist(), strict=True)}
        return {
            "step": step,
            "split": "eval",
            **means,
            "eval_pairs": self.num_rows,
            "eval_time_s": time.perf_counter() - start,
        }
