"""``hf-tp estimate --dp-replicate``: HSDP shards the state over the shard group only and adds the
gradient all-reduce across replicas to the collectives."""

from __future__ import annotations

import pytest

from hf_tp.estimate import estimate
from tests.unit.test_estimate import tiny_llama

SIZES = dict(tp=1, seq_len=64, batch_size=1, dtype="fp32")


def test_hsdp_state_is_sharded_over_the_shard_group_only() -> None:
    config = tiny_llama()
    hsdp = estimate(config, dp=4, dp_replicate=2, **SIZES)
    dp2, dp4 = estimate(config, dp=2, **SIZES), estimate(config, dp=4, **SIZES)
    # params and AdamW state per rank: those of a dp 2 run (sharded over 2), twice dp 4's
    assert (hsdp.state.parameters, hsdp.state.optimizer) == (dp2.state.parameters, dp2.state.optimizer)
    assert hsdp.state.parameters == 2 * dp4.state.parameters  # (AdamW also keeps a step count per tensor)
    stats = {(c.dim, c.collective): c for c in hsdp.comms}
    # FSDP2 gathers and reduce-scatters inside a replica (as dp 2 does), then one all-reduce per
    # unit across the 2 replicas, of the shard (half of each unit's gradients)
    want = {(c.dim, c.collective): c for c in dp2.comms}
    for key in (("dp", "all_gather"), ("dp", "reduce_scatter")):
        assert (stats[key].group_size, stats[key].count, stats[key].bytes) == (2, want[key].count, want[key].bytes)
    reduce = stats[("dp_replicate", "all_reduce")]
    assert reduce.group_size == 2 and reduce.count == want[("dp", "reduce_scatter")].count
    assert reduce.bytes == want[("dp", "reduce_scatter")].bytes // 2
    assert hsdp.to_dict()["dp_replicate"] == 2 and hsdp.world_size == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dp=4, dp_replicate=3), r"dp_replicate must divide dp \(4\): .* got dp_replicate=3"),
        (dict(dp=4, dp_replicate=0), r"dp_replicate must be a positive integer, got dp_replicate=0"),
        (dict(dp=2, cp=2, dp_replicate=2), r"dp_replicate does not combine with cp yet: drop one .*"),
    ],
)
def test_bad_hsdp_inputs_fail_early(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate(tiny_llama(), **(SIZES | kwargs))
