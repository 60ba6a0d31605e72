"""A MoE checkpoint holds one layout on every mesh, so it resumes across tp, dp (FSDP2) and ep.

Under tp > 1 hf_tp stores Qwen3-MoE's fused ``experts.gate_up_proj`` (HF ``[experts, 2I, hidden]``)
as packed halves ``[experts, 2, I, hidden]``; at tp = 1 it keeps HF's shape. A chain of runs, one
AdamW step each, every one resuming from the checkpoint of the one before on another mesh:
one rank (plain tensors) -> tp 2 -> tp 1 x dp 2 (FSDP2) -> ep 2 -> tp 2. After every load the weights and the AdamW state
(``exp_avg``, ``exp_avg_sq``, ``step``) equal, bit for bit, what was saved; the last step's weights
equal those of 5 uninterrupted steps of plain single-process HF. A checkpoint of the layout before
(HF's, at tp = 1) still loads at tp 1 and is refused at tp 2 with one line.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from transformers import CONFIG_MAPPING

import hf_tp
from hf_tp.checkpoint.dcp import _train_state, load_checkpoint, save_checkpoint
from hf_tp.compat import family_refusal
from tests.family_grid import grid_config, grid_model
from tests.helpers import batch, full, full_params, run_threaded
from tests.parity import assert_weights_after_adam_close, train_steps
from tests.unit.test_expert_parallel import _case

LR, DECAY = 1e-3, 0.01
CHAIN = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 2, 2), (2, 1, 1))  # (tp, dp, ep) of each run, in order


def _state(model, opt, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full weights and AdamW state in HF's shapes, by name (collective)."""
    out = {f"param.{k}": v for k, v in full_params(model).items()}
    for key, value in get_optimizer_state_dict(model, opt)["state"].items():
        for what in ("exp_avg", "exp_avg_sq"):
            out[f"{what}.{key}"] = full(value[what]).detach().reshape(shapes[key]).clone()
        out[f"step.{key}"] = full(value["step"]).detach().clone()
    return out


def _run(ref, data, layout, tmp: Path, index: int, resume: Path | None) -> dict:
    """One run of ``layout`` (tp, dp, ep) on threaded ranks: load ``resume`` (if any), one AdamW
    step on its dp share of ``data``, a checkpoint. Returns rank 0's state after the load
    ("loaded") and after the step ("after"), and the checkpoint's path."""
    tp, dp, ep = layout
    models = [copy.deepcopy(ref) for _ in range(tp * dp)]
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    out: dict = {}

    def rank_fn(rank: int) -> None:
        model = models[rank]
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
        hf_tp.parallelize(model, mesh, ep=ep)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        if resume is not None:
            load_checkpoint(resume, model, opt)
            loaded = _state(model, opt, shapes)
        per = data["input_ids"].shape[0] // dp
        d = mesh.get_local_rank("dp") if dp > 1 else 0
        with hf_tp.loss_parallel():
            model(**{k: v[d * per : (d + 1) * per] for k, v in data.items()}, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
        path = save_checkpoint(tmp / f"run{index}", index + 1, model, opt, {"config": {}}, [model.config])
        after = _state(model, opt, shapes)
        if rank == 0:
            out.update(path=path, after=after, loaded=loaded if resume is not None else None)

    run_threaded(tp * dp, rank_fn)
    return out


def test_moe_checkpoint_resumes_on_every_mesh(tmp_path: Path) -> None:
    _resume_chain(*_case("qwen3_moe", skewed=False), CHAIN, tmp_path)


@pytest.mark.skipif(
    "minimax_m3_vl_text" not in CONFIG_MAPPING or bool(family_refusal("minimax_m3_vl_text")),
    reason="this transformers serves no minimax_m3_vl_text",
)
def test_a_packed_dim_fsdp_shards_resumes_across_meshes(tmp_path: Path) -> None:
    """MiniMax-M3's shared expert is a 2-D ``gate_up_proj`` Linear with ``[gate; up]`` rows: at
    tp 1 x dp 2 FSDP2 shards that packed dim, so a rank's rows are no box of the packed layout.
    The checkpoint holds it gathered; a load at tp 1 x dp 2 writes each rank's rows back."""
    config = grid_config("minimax_m3_vl_text", vocab_size=300)
    chain = ((1, 2, 1), (2, 1, 1), (1, 2, 1), (1, 1, 1))
    _resume_chain(grid_model(config), batch(config.vocab_size, b=4, s=13, pad=None), chain, tmp_path)


def _resume_chain(ref, data, chain, tmp_path: Path) -> None:
    """Run ``chain``'s layouts in turn, each resuming from the one before: every load equals what
    was saved, bit for bit, and the last weights those of as many uninterrupted single-rank steps."""
    want = train_steps(copy.deepcopy(ref), data, steps=len(chain), lr=LR)
    previous = None
    for index, layout in enumerate(chain):
        run = _run(ref, data, layout, tmp_path, index, previous and previous["path"])
        if previous is not None:
            assert sorted(run["loaded"]) == sorted(previous["after"])
            for name, value in previous["after"].items():
                torch.testing.assert_close(run["loaded"][name], value, rtol=0, atol=0, msg=f"{layout}: {name}")
        previous = run
    got = {k.removeprefix("param."): v for k, v in previous["after"].items() if k.startswith("param.")}
    assert_weights_after_adam_close(got, want.params, want.start, want.grads)


def test_a_checkpoint_in_the_older_layout_loads_at_tp1_and_is_refused_at_tp2(tmp_path: Path) -> None:
    ref, data = _case("qwen3_moe", skewed=False)
    saved = {}

    def write(rank: int) -> None:  # what save_checkpoint wrote at tp 1 before: the live (HF) layout
        model = copy.deepcopy(ref)
        hf_tp.parallelize(model, hf_tp.build_mesh(tp=1, dp=1, device_type="cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model(**data, use_cache=False).loss.backward()
        opt.step()
        path = save_checkpoint(tmp_path / "new", 1, model, opt, {"config": {}}, [model.config])
        old = tmp_path / "old"
        old.mkdir()
        for name in ("trainer_state.json", "rng.pt"):
            (old / name).write_bytes((path / name).read_bytes())
        dcp.save(_train_state(model, opt), checkpoint_id=str(old))
        saved.update(params=full_params(model))

    run_threaded(1, write)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"

    def resume(tp: int):
        def rank_fn(rank: int) -> None:
            model = copy.deepcopy(ref)
            hf_tp.parallelize(model, hf_tp.build_mesh(tp=tp, dp=1, device_type="cpu"))
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            if tp > 1:
                with pytest.raises(ValueError, match="resume it once at tp 1 and save"):
                    load_checkpoint(tmp_path / "old", model, opt)
                return
            load_checkpoint(tmp_path / "old", model, opt)
            torch.testing.assert_close(full_params(model)[gate_up], saved["params"][gate_up], rtol=0, atol=0)

        run_threaded(tp, rank_fn)

    resume(1)
    resume(2)


def test_a_parameter_that_never_got_a_gradient_resumes_on_another_mesh(tmp_path: Path) -> None:
    """A trainable parameter with no gradient (DeepSeek-V4's indexer behind a boolean selection)
    has no AdamW state; the checkpoint holds none for it and a resume on another mesh loads the rest."""
    ref, data = _case("qwen3_moe", skewed=False)
    idle = "model.layers.0.self_attn.q_proj.weight"
    saved: dict = {}

    def run(tp: int, resume: Path | None) -> None:
        def rank_fn(rank: int) -> None:
            model = copy.deepcopy(ref)
            hf_tp.parallelize(model, hf_tp.build_mesh(tp=tp, dp=1, device_type="cpu"))
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            if resume is None:
                with hf_tp.loss_parallel():
                    model(**data, use_cache=False).loss.backward()
                model.get_parameter(idle).grad = None
                opt.step()
                path = save_checkpoint(tmp_path / "run", 1, model, opt, {"config": {}}, [model.config])
                params = full_params(model)  # collective: every rank
                if rank == 0:
                    saved.update(path=path, params=params)
                return
            load_checkpoint(resume, model, opt)
            state = get_optimizer_state_dict(model, opt)["state"]
            assert idle not in state and len(state) == len(saved["params"]) - 1
            for name, value in full_params(model).items():
                torch.testing.assert_close(value, saved["params"][name], rtol=0, atol=0, msg=name)

        run_threaded(tp, rank_fn)

    run(2, None)
    run(1, saved["path"])
