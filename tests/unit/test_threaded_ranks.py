"""The threaded ranks of tests/helpers.run_threaded: kept between calls, ended by a failure."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_threaded


def _sum_of_ranks(world_size: int) -> list[float]:
    out = [0.0] * world_size

    def fn(rank: int) -> None:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        out[rank] = t.item()

    run_threaded(world_size, fn)
    return out


def test_ranks_serve_later_calls_and_a_failure_ends_them() -> None:
    idents: list[set[threading.Thread]] = []

    def record(rank: int) -> None:
        idents[-1].add(threading.current_thread())
        assert dist.get_rank() == rank and dist.get_world_size() == 2

    for _ in range(2):
        idents.append(set())
        run_threaded(2, record)
    assert idents[0] == idents[1]  # the same two threads (and their DTensor caches)

    def fail_on_one(rank: int) -> None:
        if rank == 1:
            raise RuntimeError("boom")
        dist.barrier()  # rank 0 waits in a collective its peer never joins: released, not hung

    with pytest.raises(AssertionError, match="rank 1 failed:(.|\n)*boom"):
        run_threaded(2, fail_on_one, timeout=60)
    idents.append(set())
    run_threaded(2, record)
    assert idents[-1].isdisjoint(idents[0])  # new ranks after the failure
    assert _sum_of_ranks(2) == [1.0, 1.0] and _sum_of_ranks(4) == [6.0] * 4
