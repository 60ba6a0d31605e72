"""Experts sharded over every dp rank (expert parallelism at ep < dp): FSDP2 shards each rank's
experts over the dp ranks outside its ep group, so per-rank expert state is 1/dp of the experts.
Against plain single-process HF at dp4 x ep2 (tp 1 and tp 2, with an ep rank whose experts get no
token in layer 0): logits, loss, every gradient, AdamW weights. A checkpoint saved at dp4 x ep2
resumes at ep 4 and ep 1 with the same weights and optimizer state, and exports the same weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import hf_tp
from hf_tp.checkpoint.dcp import load_checkpoint, save_checkpoint
from hf_tp.checkpoint.hf_folder import export_checkpoint
from tests.helpers import full, full_params, run_threaded
from tests.parity import assert_parity, train_steps
from tests.unit.test_expert_parallel import _case
from tests.unit.test_export_stream import folder_tensors

DP, EP = 4, 2


def _local_rows(data: dict, mesh) -> tuple[dict, slice]:
    per = data["input_ids"].shape[0] // DP
    d = mesh.get_local_rank("dp")
    rows = slice(d * per, (d + 1) * per)
    return {k: v[rows] for k, v in data.items()}, rows


@pytest.mark.parametrize("tp", [1, 2])
def test_experts_sharded_over_dp_match_plain_hf(tp: int) -> None:
    ref, data = _case("qwen3_moe", skewed=True, idle_rank=True)
    want = train_steps(copy.deepcopy(ref), data, steps=2)
    candidates = [copy.deepcopy(ref) for _ in range(tp * DP)]

    def rank_fn(rank: int) -> None:
        model = candidates[rank]
        mesh = hf_tp.build_mesh(tp=tp, dp=DP, device_type="cpu")
        hf_tp.parallelize(model, mesh, ep=EP)
        local, rows = _local_rows(data, mesh)
        got = train_steps(model, local, steps=2, ctx=hf_tp.loss_parallel, dp_group=mesh["dp"].get_group())
        assert_parity(got, want, rows)
        for name, p in model.named_parameters():  # each rank holds 1/(dp * tp) of the experts
            if ".experts." in name:
                assert p.to_local().numel() * DP * tp == p.numel(), (name, p.placements)

    run_threaded(tp * DP, rank_fn)


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Full weights and AdamW moments, by name."""
    out = {f"param.{k}": v for k, v in full_params(model).items()}
    for key, value in get_optimizer_state_dict(model, opt)["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{moment}.{key}"] = full(value[moment]).detach().clone()
    return out


def test_checkpoint_at_ep_below_dp_resumes_at_other_ep_and_exports(tmp_path: Path) -> None:
    ref, data = _case("qwen3_moe", skewed=True)
    states: dict[int, dict] = {}
    ckpt: list[Path] = []

    def run(ep: int, resume: bool):
        candidates = [copy.deepcopy(ref) for _ in range(DP)]

        def rank_fn(rank: int) -> None:
            model = candidates[rank]
            mesh = hf_tp.build_mesh(tp=1, dp=DP, device_type="cpu")
            hf_tp.parallelize(model, mesh, ep=ep)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            if resume:
                load_checkpoint(ckpt[0], model, opt)
            else:
                local, _ = _local_rows(data, mesh)
                model(**local, use_cache=False).loss.backward()
                opt.step()
                path = save_checkpoint(tmp_path / "run", 1, model, opt, {"config": {}}, [model.config])
                if rank == 0:
                    ckpt.append(path)
            state = _state(model, opt)
            if rank == 0:
                states[ep if resume else 0] = state

        run_threaded(DP, rank_fn)

    run(EP, resume=False)
    for ep in (4, 1):
        run(ep, resume=True)
        assert sorted(states[ep]) == sorted(states[0])
        for name, value in states[0].items():
            torch.testing.assert_close(states[ep][name], value, rtol=0, atol=0, msg=f"ep {ep}: {name}")
    exported = folder_tensors(export_checkpoint(ckpt[0], tmp_path / "export"))
    layer0 = "model.layers.0.mlp.experts"
    gate_up = states[0][f"param.{layer0}.gate_up_proj"].float()  # the model is float64; exported in fp32
    n = gate_up.shape[1] // 2
    torch.testing.assert_close(exported[f"{layer0}.5.gate_proj.weight"], gate_up[5, :n], rtol=0, atol=0)
    torch.testing.assert_close(exported[f"{layer0}.5.up_proj.weight"], gate_up[5, n:], rtol=0, atol=0)
