"""HSDP (``dp_replicate``): dp = replicas x an FSDP2 shard group, on a ("dp_replicate", "dp_shard",
"tp") mesh. Training equals plain single-process HF (logits, loss, every gradient, AdamW steps),
as plain dp does, and a checkpoint moves between HSDP and plain dp exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate

import hf_tp
from hf_tp.checkpoint.dcp import load_checkpoint, save_checkpoint
from hf_tp.parallel.grad import clip_grad_norm
from tests.helpers import batch, full_params, run_threaded, tiny_config, tiny_model
from tests.parity import ParityCase, train_steps


@pytest.mark.parametrize(("tp", "dp", "replicate"), [(1, 4, 2), (2, 4, 2)])
def test_hsdp_equals_plain_hf(tp: int, dp: int, replicate: int) -> None:
    case = ParityCase(family="llama", tp=tp, dp=dp, dp_replicate=replicate, b=4, pad=None, sp=tp > 1)
    start, data, want = case.reference()
    candidates = [copy.deepcopy(start) for _ in range(tp * dp)]

    def rank_fn(rank: int) -> None:
        model = candidates[rank]
        case.check(model, data, want)
        q = model.model.layers[0].self_attn.q_proj.weight
        assert q.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")[: q.device_mesh.ndim]
        assert q.placements[0] == Replicate() and not q.placements[1].is_replicate()  # over dp_replicate, dp_shard

    run_threaded(tp * dp, rank_fn)


def _run(ref, data, replicate: int, root: Path, resume: Path | None) -> dict:
    """One AdamW step at dp 4 (``replicate`` replicas) after loading ``resume``; rank 0's full
    weights after the load and after the step, the step's gradient norm and the checkpoint."""
    models = [copy.deepcopy(ref) for _ in range(4)]
    out: dict = {}

    def rank_fn(rank: int) -> None:
        model = models[rank]
        mesh = hf_tp.build_mesh(tp=1, dp=4, device_type="cpu", dp_replicate=replicate)
        hf_tp.parallelize(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        loaded = None
        if resume is not None:
            load_checkpoint(resume, model, opt)
            loaded = full_params(model)
        d = mesh.get_local_rank("dp")
        model(**{k: v[d : d + 1] for k, v in data.items()}, use_cache=False).loss.backward()
        norm = clip_grad_norm(model.parameters(), 0.0)  # 0: measure only (the trainer's exact global norm)
        opt.step()
        opt.zero_grad()
        path = save_checkpoint(
            root / f"r{replicate}-{resume is not None}", 1, model, opt, {"config": {}}, [model.config]
        )
        after = full_params(model)
        if rank == 0:
            out.update(path=path, loaded=loaded, after=after, norm=norm)

    run_threaded(4, rank_fn)
    return out


def test_checkpoint_moves_between_hsdp_and_dp(tmp_path: Path) -> None:
    config = tiny_config("llama")
    ref = tiny_model(config, dtype=torch.float64)
    data = batch(config.vocab_size, b=4, s=12, pad=None)
    want = train_steps(copy.deepcopy(ref), data, steps=3, lr=1e-3)
    first = _run(ref, data, 2, tmp_path, None)  # HSDP 2 x 2 ...
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in want.grads.values()]))
    torch.testing.assert_close(first["norm"].to(want_norm.dtype), want_norm, rtol=1e-6, atol=0)
    second = _run(ref, data, 1, tmp_path, first["path"])  # ... resumed at dp 4 ...
    third = _run(ref, data, 2, tmp_path, second["path"])  # ... and back
    for before, after in ((first, second), (second, third)):
        for name, value in before["after"].items():
            torch.testing.assert_close(after["loaded"][name], value, rtol=0, atol=0, msg=name)
    for name, value in want.params.items():  # AdamW moments and step count travelled too
        torch.testing.assert_close(third["after"][name], value, rtol=1e-7, atol=1e-9, msg=name)
