"""``--precompute-ref``: DPO's reference log-probs computed once, before training, in one pass over
the training pairs (each dp rank scores its share, all ranks gather them), stored as two columns
of the dataset; the training steps then read them from their batches instead of running the
reference forward. The reference model is freed once the pass is done."""

from __future__ import annotations

from collections.abc import Callable

import datasets
import torch
import torch.distributed as dist

from hf_tp.parallel.linear_ce import _all_gather_single

CHOSEN, REJECTED = "ref_chosen_logps", "ref_rejected_logps"


class Stored:
    """The reference log-probs a batch carries (``ref_logps``: its rows' values, chosen then rejected)."""

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "ref_logps" not in batch:
            raise ValueError("--precompute-ref: this batch carries no reference log-probs (ref_logps)")
        return batch["ref_logps"]


def with_reference_logps(
    data: datasets.Dataset,
    reference: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    collate: Callable[[list[dict]], dict[str, torch.Tensor]],
    *,
    batch_size: int,
    dp_rank: int,
    dp: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> datasets.Dataset:
    """``data`` (pair examples) with the :data:`CHOSEN` / :data:`REJECTED` log-probs of ``reference``.

    Every rank runs the same number of forwards (collectives inside the model must line up): the
    last rounds are filled with copies of the first pair, whose results are dropped."""
    n, per_round = len(data), batch_size * dp
    chosen, rejected = [], []
    for start in range(0, n, per_round):
        rows = [start + dp_rank * batch_size + i for i in range(batch_size)]
        batch = collate([data[r if r < n else 0] for r in rows])
        logps = reference({k: v.to(device) for k, v in batch.items()}).float()
        gathered = torch.empty((dp * logps.numel(),), dtype=logps.dtype, device=logps.device)
        _all_gather_single(gathered, logps, group=group)
        for rank_logps in gathered.view(dp, -1).cpu():
            chosen += rank_logps[:batch_size].tolist()
            rejected += rank_logps[batch_size:].tolist()
    return data.add_column(CHOSEN, chosen[:n]).add_column(REJECTED, rejected[:n])
