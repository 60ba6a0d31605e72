"""A model's own dropout under tp (issue 26, item 3; Seed-OSS ships attention_dropout and
residual_dropout 0.1): head-sharded attention probabilities and the sequence-sharded residual
stream draw a mask per tp rank; the residual stream without sequence parallelism the same mask on
every tp rank; dp ranks their own; keep rate 1 - p within 3 sigma; the activation-checkpointing
recompute redraws the forward's masks; p = 0 installs nothing."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import hf_tp
from hf_tp.core.record import record_of
from hf_tp.dropout.dropout_install import region_kinds
from tests.family_grid import grid_config, grid_model
from tests.helpers import full_grads, run_threaded

P = 0.3


def _seed_oss(p: float = P) -> torch.nn.Module:
    model = grid_model(grid_config("seed_oss", attention_dropout=p, residual_dropout=p)).train()
    model.config._attn_implementation = "eager"  # the probabilities' dropout as F.dropout (sdpa: forked RNG)
    return model


def _run(model, tp: int, dp: int, sp: bool = True, ac: bool = False, record: bool = True) -> dict[int, tuple]:
    """Per global rank: (recorded (kind, owner, keep mask) per dropout call, loss, full grads)."""
    copies = [copy.deepcopy(model) for _ in range(tp * dp)]
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    out: dict[int, tuple] = {}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
        m = hf_tp.parallelize(copies[rank], mesh, sequence_parallel=sp, loss_parallel=sp, activation_checkpointing=ac)
        record_of(m).dropout.record = [] if record else None
        with hf_tp.loss_parallel() if sp else contextlib.nullcontext():
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        out[rank] = (record_of(m).dropout.record, value, None if record else full_grads(m))

    run_threaded(tp * dp, rank_fn)
    return out


def _keep_rate_ok(keep: torch.Tensor) -> bool:
    n = keep.numel()
    return abs(int(keep.sum()) - n * (1 - P)) <= 3 * math.sqrt(n * P * (1 - P))


@pytest.mark.parametrize("sp", [True, False])
def test_masks_per_tp_rank_where_sharded_shared_where_replicated_own_per_dp(sp: bool) -> None:
    runs = _run(_seed_oss(), tp=2, dp=2, sp=sp)  # global ranks (dp, tp): 0, 1 | 2, 3
    calls = runs[0][0]
    # per layer: the attention probabilities, then the residual dropout after o_proj and after down_proj
    assert [k for k, _, _ in calls] == (["shard", "shard", "shard"] if sp else ["shard", "replicate", "replicate"]) * 2
    for i, (kind, _, keep) in enumerate(calls):
        same_tp = torch.equal(keep, runs[1][0][i][2])
        assert same_tp == (kind == "replicate"), (i, kind)  # head or sequence shards: a mask per rank
        assert not torch.equal(keep, runs[2][0][i][2])  # another dp rank: other rows, its own mask
        assert all(_keep_rate_ok(runs[r][0][i][2]) for r in runs), i
    assert all(not torch.equal(calls[0][2], c[2]) for c in calls[3:4])  # the next layer: another draw


def test_activation_checkpointing_recompute_redraws_the_same_masks() -> None:
    model = _seed_oss()
    plain, ac = _run(model, tp=2, dp=1, record=False), _run(model, tp=2, dp=1, ac=True, record=False)
    assert plain[0][1] == ac[0][1] and plain[0][1] == plain[1][1]
    for name, g in plain[0][2].items():
        assert torch.equal(g, ac[0][2][name]), name


def test_zero_dropout_installs_nothing_and_eval_is_the_identity() -> None:
    copies = [_seed_oss(0.0), _seed_oss(0.0), _seed_oss().eval(), _seed_oss().eval()]

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=2, device_type="cpu")
        a, b = (hf_tp.parallelize(copies[i], mesh) for i in (rank, 2 + rank))
        assert record_of(a).dropout is None and record_of(b).dropout.counter == 0
        ids = torch.arange(3, 15)[None]
        with hf_tp.loss_parallel():
            la, lb = (m(input_ids=ids, labels=ids, use_cache=False).loss for m in (a, b))
        assert torch.equal(la.full_tensor(), lb.full_tensor())  # same weights (seed 0), no mask drawn

    run_threaded(2, rank_fn)


def test_region_kinds_of_a_moe_plan() -> None:
    model = grid_model(grid_config("qwen3_moe"))
    plan = hf_tp.get_adapter(model.config).layer_plan(hf_tp.adapters.PlanOptions())
    kinds = region_kinds(plan, sequence_parallel=True)
    assert kinds == {"": "shard", "self_attn": "shard", "mlp": "replicate"}  # the MoE block runs on the gathered input
