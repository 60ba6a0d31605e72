"""clip_grad_norm is exact across DTensor meshes and matches torch on plain tensors."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hf_tp.parallel.grad import clip_grad_norm
from tests.helpers import run_threaded


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=g), torch.randn(5, generator=g), torch.randn(4, 4, generator=g)]


def test_matches_torch_on_plain_tensors() -> None:
    a = [torch.nn.Parameter(torch.zeros_like(t)) for t in _grads()]
    b = [torch.nn.Parameter(torch.zeros_like(t)) for t in _grads()]
    for p, q, g in zip(a, b, _grads(), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    want = torch.nn.utils.clip_grad_norm_(a, 1.0)
    got = clip_grad_norm(b, 1.0)
    torch.testing.assert_close(got, want)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(q.grad, p.grad)


def test_mixed_meshes_give_the_global_norm() -> None:
    # Two different meshes over the same ranks (torch's clip_grad_norm_ cannot stack their norms)
    # plus a plain tensor. 2-D (dp, tp) meshes are covered by the real-process training tests:
    # torch's threaded process group mismatches collectives issued on two sub-groups in a row.
    grads = _grads()
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))

    def rank_fn(rank: int) -> None:
        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
        params = [
            torch.nn.Parameter(distribute_tensor(torch.zeros(8, 6), tp, [Shard(1)])),
            torch.nn.Parameter(distribute_tensor(torch.zeros(5), other, [Replicate()])),
            torch.nn.Parameter(torch.zeros(4, 4)),
        ]
        params[0].grad = distribute_tensor(grads[0].clone(), tp, [Shard(1)])
        params[1].grad = distribute_tensor(grads[1].clone(), other, [Replicate()])
        params[2].grad = grads[2].clone()
        norm = clip_grad_norm(params, 0.5)
        torch.testing.assert_close(norm, want_norm)
        scale = 0.5 / (want_norm + 1e-6)
        torch.testing.assert_close(params[0].grad.full_tensor(), grads[0] * scale)
        torch.testing.assert_close(params[1].grad.full_tensor(), grads[1] * scale)
        torch.testing.assert_close(params[2].grad, grads[2] * scale)

    run_threaded(2, rank_fn)


def test_a_2d_mesh_norm_is_one_all_reduce(monkeypatch) -> None:
    # (dp, tp) shards, dp shards with tp copies, and a plain tensor: torch's full_tensor() would
    # reduce a 2-D norm dim by dim; here the whole norm is one all-reduce.
    import torch.distributed as dist

    from tests.helpers import CollectiveCounter

    grads = _grads()
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    calls = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1) or real_all_reduce(*a, **k))

    def rank_fn(rank: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        layouts = [[Shard(0), Shard(1)], [Shard(0), Replicate()]]
        params = [
            torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, pl))
            for g, pl in zip(grads[:2], layouts, strict=True)
        ]
        params.append(torch.nn.Parameter(torch.zeros_like(grads[2])))
        for p, g, pl in zip(params[:2], grads[:2], layouts, strict=True):
            p.grad = distribute_tensor(g.clone(), mesh, pl)
        params[2].grad = grads[2].clone()
        with CollectiveCounter() as comm:
            norm = clip_grad_norm(params, 0.0)
        torch.testing.assert_close(norm, want_norm)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()  # no DTensor redistribution

    run_threaded(4, rank_fn)
    assert len(calls) == 4  # one per rank
