"""A model parallelized on the meta device and materialized the usual way, ``model.to_empty``,
trains like the same model parallelized from real weights: each parameter stays the same object
and keeps the gradient hooks parallelize attached (at ep = dp the experts' dp average, which a
plain ``to_empty`` silently dropped)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hf_tp
from tests.family_grid import grid_config, grid_model
from tests.helpers import run_threaded, tiny_config, tiny_model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize(("model_type", "tp", "dp", "ep"), [("qwen3", 2, 1, 1), ("qwen3_moe", 1, 2, 2)])
def test_meta_model_materialized_with_to_empty_trains_like_from_real_weights(
    model_type: str, tp: int, dp: int, ep: int
) -> None:
    if ep > 1:
        config = grid_config(model_type, num_experts=8)
        ref = grid_model(config).float()
    else:
        config = tiny_config(model_type)
        ref = tiny_model(config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    metas, refs = [copy.deepcopy(meta) for _ in range(tp * dp)], [copy.deepcopy(ref) for _ in range(tp * dp)]
    ids = torch.randint(3, config.vocab_size, (2 * dp, 12), generator=torch.Generator().manual_seed(0))
    mismatched: dict[int, list[str]] = {}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
        want = hf_tp.parallelize(refs[rank], mesh, ep=ep)
        got = hf_tp.parallelize(metas[rank], mesh, ep=ep)
        before = [id(p) for p in got.parameters()]
        got.to_empty(device="cpu")
        assert [id(p) for p in got.parameters()] == before  # the same objects, as parallelize left them
        with torch.no_grad():
            for (name, p), (other, q) in zip(want.named_parameters(), got.named_parameters(), strict=True):
                assert name == other
                _local(q).copy_(_local(p))
            for (_, b), (_, c) in zip(want.named_buffers(), got.named_buffers(), strict=True):
                c.copy_(b)
        rows = ids[mesh.get_local_rank("dp") * 2 :][:2]
        for model in (want, got):
            model.train()
            with hf_tp.loss_parallel():
                model(input_ids=rows, labels=rows).loss.backward()
        mismatched[rank] = [
            name
            for (name, p), (_, q) in zip(want.named_parameters(), got.named_parameters(), strict=True)
            if not torch.equal(_local(p.grad), _local(q.grad))
        ]

    run_threaded(tp * dp, rank_fn)
    assert all(not names for names in mismatched.values()), mismatched
