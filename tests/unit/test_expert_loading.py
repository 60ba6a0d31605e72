"""Loading a MoE checkpoint that holds one tensor per expert (the Hub's usual layout, which
transformers stacks into fused 3-D parameters on load): each rank reads only its box of every
fused tensor (its experts, tp slice and FSDP2 shard). Every parameter a rank ends up with equals,
bit for bit, what ``from_pretrained`` followed by ``parallelize`` gives it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import hf_tp
from hf_tp.checkpoint.load import build_empty, file_index, sliced_sources
from hf_tp.moe import expert_files
from hf_tp.run import model as train_model
from hf_tp.run.config import TrainConfig
from hf_tp.run.model import build_parallel_model
from tests.family_grid import grid_config, grid_model, needs_later_release
from tests.helpers import run_threaded

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 4, 2), (2, 2, 2)]  # (tp, dp, ep)


def _saved(model_type: str, folder: Path) -> Path:
    config = grid_config(model_type, num_experts=8, num_local_experts=8, n_routed_experts=8, vocab_size=300)
    grid_model(config).float().save_pretrained(folder, max_shard_size="40KB")
    return folder


def _one_meta_build(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Every threaded rank gets a copy of one meta model: accelerate's ``init_empty_weights``
    patches ``nn.Module.register_parameter`` process-wide, which the other threads' parallelize
    would pick up (separate processes in real runs)."""
    empty = build_empty(AutoModelForCausalLM.from_pretrained(folder).config)
    monkeypatch.setattr(train_model, "build_empty", lambda config: copy.deepcopy(empty))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_per_expert_files_load_by_boxes_as_from_pretrained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str
) -> None:
    if needs_later_release(model_type):
        return
    folder = _saved(model_type, tmp_path / "model")
    _one_meta_build(monkeypatch, folder)
    index = file_index(folder)
    assert len({f for f, _ in index.values()}) >= 4  # several files
    assert any(".experts.0." in k for k in index) == (model_type != "gpt_oss")  # one tensor per expert
    empty = build_empty(AutoModelForCausalLM.from_pretrained(folder).config)
    fused = sliced_sources(empty, folder)  # (not None: no rank loads the whole model)
    if model_type == "gpt_oss":  # fused in its files too: read by name, by boxes once packed at tp 2
        assert fused == {}
    else:
        assert set(fused) == {n for n, p in empty.named_parameters() if p.dim() == 3}
    for tp, dp, ep in LAYOUTS:
        got, want = _both_paths(folder, tp, dp, ep)
        for rank in range(tp * dp):
            assert got[rank].keys() == want[rank].keys()
            for name, value in want[rank].items():
                assert torch.equal(got[rank][name], value), (model_type, (tp, dp, ep), rank, name)


def _both_paths(folder: Path, tp: int, dp: int, ep: int) -> tuple[dict, dict]:
    """Each rank's parameters (local tensors), then its loss and gradients after one forward and
    backward: ``hf-tp train``'s loading, and from_pretrained then parallelize. (The gradients
    check what parallelize attached to the meta parameters: a hook lost on materializing them
    left expert gradients unaveraged over dp.)"""
    refs = [AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) for _ in range(tp * dp)]
    ids = torch.randint(0, refs[0].config.vocab_size, (2 * dp, 16), generator=torch.Generator().manual_seed(0))
    got: dict[int, dict[str, torch.Tensor]] = {}
    want: dict[int, dict[str, torch.Tensor]] = {}

    def state(model: torch.nn.Module, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
        with hf_tp.loss_parallel():
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
        out["loss"] = _local(loss).detach().clone()
        return {**out, **{f"{n}.grad": _local(p.grad).clone() for n, p in model.named_parameters()}}

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=tp, dp=dp, device_type="cpu")
        rows = ids[mesh.get_local_rank("dp") * 2 :][:2]
        cfg = TrainConfig(model=str(folder), tp=tp, dp=dp, ep=ep, seq_len=16).resolve()
        got[rank] = state(build_parallel_model(cfg, mesh, torch.device("cpu")), rows)
        refs[rank].train()
        want[rank] = state(hf_tp.parallelize(refs[rank], mesh, ep=ep), rows)

    run_threaded(tp * dp, rank_fn)
    return got, want


def test_a_rank_reads_only_its_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # dp 4 x ep 2 (tp 1): a rank's experts are 4 of 8, sharded again over dp_out 2: it reads 2
    # experts' tensors of each MoE layer, never another expert's.
    folder = _saved("qwen3_moe", tmp_path / "model")
    _one_meta_build(monkeypatch, folder)
    read: dict[int, set[int]] = {}
    original = expert_files._Files.tensor

    def tensor(self, key: str):
        if ".experts." in key:
            read.setdefault(torch.distributed.get_rank(), set()).add(int(key.split(".experts.")[1].split(".")[0]))
        return original(self, key)

    monkeypatch.setattr(expert_files._Files, "tensor", tensor)

    def rank_fn(rank: int) -> None:
        mesh = hf_tp.build_mesh(tp=1, dp=4, device_type="cpu")
        build_parallel_model(
            TrainConfig(model=str(folder), tp=1, dp=4, ep=2, seq_len=16).resolve(), mesh, torch.device("cpu")
        )

    run_threaded(4, rank_fn)
    assert all(len(experts) == 2 for experts in read.values()), read
    assert set().union(*read.values()) == set(range(8)), read


def test_conversions_it_cannot_slice_fall_back_to_from_pretrained(tmp_path: Path) -> None:
    # An expert missing from the files: not a whole stacked tensor, so not read by boxes (and
    # from_pretrained then names what is missing).
    folder = _saved("qwen3_moe", tmp_path / "model")
    model = build_empty(AutoModelForCausalLM.from_pretrained(folder).config)
    shapes = {k: s for k, (_, s) in file_index(folder).items() if ".layers.0.mlp.experts.7." not in k}
    fused = expert_files.fused_sources(model, shapes)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in fused
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    assert sliced_sources(copy.deepcopy(model), folder) is not None  # the whole folder: by boxes
    # The same folder without that expert's tensors: not loaded by boxes (from_pretrained instead).
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(f).items() if ".layers.0.mlp.experts.7." not in k}
        save_file(tensors, str(f), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    assert sliced_sources(copy.deepcopy(model), folder) is None


def test_a_merged_lora_export_reads_a_per_expert_base(tmp_path: Path) -> None:
    # hf-tp export --merge of a LoRA run on a MoE base stored one tensor per expert: the base
    # experts come back as the files hold them, an adapted projection as base + alpha / r * B @ A.
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from hf_tp.checkpoint.lora_export import merged_reader
    from hf_tp.checkpoint.stream import write_shards

    folder = _saved("qwen3_moe", tmp_path / "model")
    base = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    q = "model.layers.0.self_attn.q_proj"
    a, b = torch.randn(4, base[f"{q}.weight"].shape[1]), torch.randn(base[f"{q}.weight"].shape[0], 4)
    ckpt = tmp_path / "ckpt"
    dcp.save(
        {f"model.{q}.lora_A.default.weight": a, f"model.{q}.lora_B.default.weight": b}, checkpoint_id=ckpt, no_dist=True
    )
    config = AutoModelForCausalLM.from_pretrained(folder).config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    read = merged_reader(ckpt, model, {"model": str(folder), "lora_r": 4, "lora_alpha": 8})
    (tmp_path / "out").mkdir()
    write_shards(ckpt, model, tmp_path / "out", torch.float32, "1GB", read)
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == base.keys()
    for key, value in base.items():
        want = value + 2.0 * (b @ a) if key == f"{q}.weight" else value
        torch.testing.assert_close(merged[key], want, rtol=0, atol=1e-6 if key == f"{q}.weight" else 0)
