"""How expert parallelism's dispatch sizes its all-to-alls: a strategy object on each experts module.

Training routes by the router's choices (:data:`MEASURED`): the dispatch counts the rows each ep
rank gets, exchanges the counts and reads them back to Python. ``hf-tp estimate`` runs on fake
tensors, which have no values to count, and installs :data:`BALANCED` on the experts it simulates
(:func:`set_routing`): every expert receives the same number of (token, choice) rows. The
dispatch itself (:mod:`hf_tp.moe.expert_parallel`) has one path and calls the strategy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from hf_tp.core.record import facts_of


def even_split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` destinations, the remainder one each to the first ones."""
    return [total // parts + (i < total % parts) for i in range(parts)]


class Routing:
    """Sizes from the router's choices (every real run): rows with an id past the last expert
    (some routers mark unused choices so) are dropped, counts are exchanged and read back."""

    name = "measured"

    def kept(self, flat_expert: torch.Tensor, experts: int) -> torch.Tensor | None:
        """A mask of the (token, choice) rows to dispatch, or None for all of them."""
        return flat_expert < experts

    def sizes(self, dest: torch.Tensor, ep: int, group) -> tuple[list[int], list[int]]:
        """(rows sent to, rows received from) each ep rank; ``dest`` is each row's ep rank, sorted."""
        send = torch.bincount(dest, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return send.tolist(), recv.tolist()

    def load(self, ids: torch.Tensor, local: int) -> torch.Tensor:
        """Rows each of this rank's ``local`` experts received (``ids``: the local expert of each row)."""
        return torch.bincount(ids, minlength=local)


class BalancedRouting(Routing):
    """Every expert gets the same number of rows: each rank sends ``rows / ep`` to every ep rank (a
    remainder one row each to the first ranks) and every choice counts. The count exchange still
    runs, so the collectives are the real program's; the row all-to-alls are their size under
    perfectly even routing (real routing is uneven: a hot rank moves more). For simulations on fake
    tensors (``hf-tp estimate``), never for training."""

    name = "balanced"

    def kept(self, flat_expert: torch.Tensor, experts: int) -> torch.Tensor | None:
        return None

    def sizes(self, dest: torch.Tensor, ep: int, group) -> tuple[list[int], list[int]]:
        even = even_split(dest.shape[0], ep)
        send = torch.tensor(even, dtype=torch.int64, device=dest.device)
        dist.all_to_all_single(torch.empty_like(send), send, group=group)
        return even, [even[dist.get_rank(group)]] * ep  # every rank splits its rows alike

    def load(self, ids: torch.Tensor, local: int) -> torch.Tensor:
        return torch.tensor(even_split(len(ids), local))


MEASURED = Routing()
BALANCED = BalancedRouting()


def set_routing(experts: Iterable[nn.Module], routing: Routing) -> None:
    """Install ``routing`` on experts modules that expert parallelism dispatches (others are left as they are)."""
    for module in experts:
        shard = getattr(facts_of(module), "experts", None)
        if shard is not None:
            shard.routing = routing
