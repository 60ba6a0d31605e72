"""What a collective costs on a ring of n ranks, and one step's collectives of one kind: shared by
the plan (collectives derived from styles) and the estimate (collectives counted in a traced step)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Bytes one rank sends per byte of full-size buffer in a ring of n ranks.
RING_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "all_to_all": lambda n: (n - 1) / n,
}


@dataclass(frozen=True)
class CommStat:
    """The collectives of one kind on one mesh dim during one training step, on one rank.

    ``bytes`` sums the full-size buffers (gathered output / reduce input / reduced tensor);
    ``sent_bytes`` is what one rank sends with ring algorithms (e.g. (n-1)/n of an all-gather).
    """

    dim: str
    collective: str
    group_size: int
    count: int
    bytes: int
    sent_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)
